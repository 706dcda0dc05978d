"""Vocabulary parallelism over the TP group (Megatron-LM's ``VocabParallelEmbedding`` and column-parallel output
layer with ``vocab_parallel_cross_entropy``, Shoeybi et al. 2019; torchtitan's ``loss_parallel``), applied right
after TP (``apply.apply_plan``).

* The token embedding's weight [V, H] is a DTensor ``Shard(0)`` over the TP mesh: rank r holds rows
  [r*V/tp, (r+1)*V/tp). Its lookup runs on the local rows: ids outside them look up row 0 and their output rows
  are zeroed, and the partial outputs are summed over the TP group (Megatron's g: one all-reduce of [B, S, H]
  forward, identity backward).
* The LM head's weight [V, H] is the same layout read as output columns (column parallel): its input goes through
  Megatron's f (identity forward, all-reduce of the input gradient backward) and its output, this rank's
  [B, S, V/tp] logits, is returned as ``VocabLogits``: a DTensor ``Shard(-1)`` over the TP mesh. A tied head keeps
  the embedding's sharded Parameter, so the tie stays one tensor.
* ``F.cross_entropy`` on ``VocabLogits`` (HF's ``labels=`` loss and ``models.gpt.lm_loss`` both call it) runs
  Megatron's vocab-parallel cross-entropy on the shards (``_ShardedCrossEntropy``): the max, the sum of
  exponentials and the target logit reduced over TP, no rank materialising [tokens, V], one fp32 buffer of the
  shard's size that becomes the softmax and then, in place, the gradient. The shape and dtype steps a loss takes
  first (``reshape``, ``view``, ``float``, slicing the tokens) keep the shards. Any other use gathers the logits
  whole (``full_tensor``, exact, differentiable) with one line, from a rank holding the head.

Under pp > 1 each stage shards what it holds: the first stage's embedding, the last stage's head (whose logits go
to the user's loss on that stage as ``VocabLogits``); a tie across stages is refused by the split itself
(``pipeline.partition``). It stays off, with the reason (``refusal``), when tp does not divide the vocabulary,
when the embedding or the head is not a plain ``nn.Embedding`` / ``nn.Linear``, and when the model uses either
weight outside that module's own call (found by the trace of the model's call: a functional use would meet a
shard where it expects the whole matrix). Under CP the head's output is gathered
(``gather_logits``): CP's hooks gather the sequence of plain tensors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_autopar.parallel.dtensor_private import (as_dtensor_subclass, own_parameters, swap_back,
                                                        swap_in_local, torch_function_disabled)
from lightning_autopar.parallel.tp_comm import CopyToTP, ReduceFromTP

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autopar.profile.analyze import ModelAnalysis
    from lightning_autopar.specs import Plan


@dataclass(frozen=True)
class VocabModules:
    """Where the vocabulary lives in the model, by path below the root (the LightningModule)."""

    embedding: str
    head: str


@dataclass
class VocabState:
    """One model's vocabulary shards: the TP mesh, this rank's rows [start, end), whether the head's output is
    gathered (CP), whether the gather line was printed, and whether this rank prints it (``reporter``)."""

    mesh: Any
    start: int
    end: int
    gather_logits: bool = False
    reported: bool = False
    reporter: bool = False
    handles: list[Any] = field(default_factory=list)

    @property
    def group(self) -> Any:
        return self.mesh.get_group()


# ------------------------------------------------------------------------------------------- refusals


def find_modules(root: nn.Module, transformer: nn.Module, analysis: ModelAnalysis,
                 split_analysis: ModelAnalysis | None, split: nn.Module | None) -> VocabModules | str:
    """The embedding and head paths below ``root``, or why they are not found. The head is the transformer's own
    (our GPT) or the wrapper's (HF ``*ForCausalLM``: ``split`` and its ``split_analysis``)."""
    names = {id(m): n for n, m in root.named_modules()}
    if not analysis.token_embedding:
        return "no token embedding found"
    embedding = _join(names[id(transformer)], analysis.token_embedding)
    if analysis.lm_head:
        return VocabModules(embedding, _join(names[id(transformer)], analysis.lm_head))
    if split is not None and split_analysis is not None and split_analysis.lm_head:
        return VocabModules(embedding, _join(names[id(split)], split_analysis.lm_head))
    tied = _tied_head(root, root.get_submodule(embedding).weight)
    return VocabModules(embedding, tied) if tied else "no LM head found"


def _tied_head(root: nn.Module, weight: Any) -> str:
    """The path of the nn.Linear holding ``weight`` (the embedding's: a tied head the analyses do not name, as in
    GPT-2, whose ``*Model`` holds every parameter), '' when none does."""
    return next((n for n, m in root.named_modules() if isinstance(m, nn.Linear) and m.weight is weight), "")


def _holders(root: nn.Module, emb: nn.Module | None, head: nn.Module | None) -> tuple[list[str], list[str]]:
    """(embeddings, heads): every nn.Embedding holding ``emb``'s weight and every nn.Linear holding ``head``'s --
    a tie across modules (T5, BART: one table for the encoder's, the decoder's and the shared embedding, and the
    head) makes each of them a lookup or a head of the same shards. None (a pipeline stage without it): no
    holders."""
    def holding(kind: type[nn.Module], weight: Any) -> list[str]:
        return [n for n, m in root.named_modules() if isinstance(m, kind) and m.weight is weight]

    return (holding(nn.Embedding, emb.weight) if emb is not None else [],
            holding(nn.Linear, head.weight) if head is not None else [])


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def module_refusal(root: nn.Module, where: VocabModules, uses: dict[str, list[tuple[str, ...]]] | None) -> str:
    """Why this model's embedding and head cannot be vocab-parallel ('' where they can): their types, shapes and
    the uses of their weights (``uses``: parameter name -> stacks of module calls at its uses, the trace's; None:
    the model's call was not traced)."""
    emb, head = root.get_submodule(where.embedding), root.get_submodule(where.head)
    if not isinstance(emb, nn.Embedding):
        return f"the token embedding '{where.embedding}' is a {type(emb).__name__}, not an nn.Embedding"
    if not isinstance(head, nn.Linear) or tuple(head.weight.shape) != tuple(emb.weight.shape):
        return f"the LM head '{where.head}' is not an nn.Linear of the embedding's shape {tuple(emb.weight.shape)}"
    embeddings, heads = _holders(root, emb, head)
    odd = next((n for n in embeddings if not _plain_embedding(root.get_submodule(n))), None)
    if odd is not None:
        return f"the token embedding '{odd}' renormalises or scales its gradient by frequency"
    if uses is None:
        return "the model's call could not be traced to see where its embedding and head weights are used"
    mine = {*embeddings, *heads}
    for name, param in root.named_parameters(remove_duplicate=False):
        if param is emb.weight or param is head.weight:
            outside = [s[-1] for s in uses.get(name, []) if not s or s[-1] not in mine]
            if outside:
                return (f"'{name}' is used outside its module's call (in '{outside[0] or 'the root'}'), where a "
                        "vocabulary shard would stand for the whole matrix")
    return ""


def _plain_embedding(emb: nn.Embedding) -> bool:
    return emb.max_norm is None and not emb.scale_grad_by_freq and not emb.sparse


def refusal(plan: Plan, rows: int, model_refusal: str) -> str:
    """Why ``plan`` runs the embedding and head whole on every TP rank ('' when vocab-parallel): ``rows`` the
    embedding's, ``model_refusal`` the model's own reason (``module_refusal``)."""
    if plan.tp == 1:
        return "tp=1"
    if rows % plan.tp:
        return f"tp={plan.tp} does not divide the vocabulary ({rows} rows)"
    return model_refusal


# ------------------------------------------------------------------------------------------- apply


def apply_vocab_parallel(root: nn.Module, where: VocabModules, tp_mesh: DeviceMesh, rows: int,
                         gather_logits: bool = False, first_replica: bool = True) -> VocabState:
    """Shard ``where``'s embedding by vocabulary rows and its head by output columns over ``tp_mesh`` (module doc),
    in place; a tie stays one Parameter, and every module holding it looks up / projects through the shards
    (``_holders``). ``rows``: the vocabulary (the embedding's rows, read before a pipeline split, after which a
    stage holds only its own part: the embedding, the head, or neither -- a stand-in in their place).
    ``gather_logits``: the head returns the whole logits (CP). ``first_replica``: this rank is the first of its data-
    and context-parallel groups (with the head and TP rank 0, it prints the gather line)."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    shard = rows // tp
    emb, head = _held(root, where.embedding, nn.Embedding), _held(root, where.head, nn.Linear)
    state = VocabState(tp_mesh, rank * shard, (rank + 1) * shard, gather_logits,
                       reporter=head is not None and rank == 0 and first_replica)
    params = [m.weight for m in (emb, head) if m is not None]
    if head is not None and head.bias is not None:
        params.append(head.bias)
    for param in dict.fromkeys(params):
        _shard_everywhere(root, param, tp_mesh)
    embeddings, heads = _holders(root, emb, head)
    for name in embeddings:
        module = root.get_submodule(name)
        state.handles += [module.register_forward_pre_hook(_embedding_pre(state), with_kwargs=True),
                          module.register_forward_hook(_embedding_post(state))]
    for name in heads:
        module = root.get_submodule(name)
        state.handles += [module.register_forward_pre_hook(_head_pre(state), with_kwargs=True),
                          module.register_forward_hook(_head_post(state))]
    return state


def _held(root: nn.Module, path: str, kind: type[nn.Module]) -> nn.Module | None:
    """The module at ``path`` where this rank holds it (a ``kind``), None where a pipeline stand-in is there."""
    module = root.get_submodule(path)
    return module if isinstance(module, kind) else None


def _shard_everywhere(root: nn.Module, param: nn.Parameter, mesh: DeviceMesh) -> None:
    """``param`` replaced by its rows sharded over ``mesh`` (a DTensor ``Shard(0)``) in every module holding it, so
    a tie (the head to the embedding, BERT's decoder bias to its prediction head's) stays one Parameter."""
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]), requires_grad=param.requires_grad)
    for module in root.modules():
        for name, held in list(own_parameters(module).items()):
            if held is param:
                setattr(module, name, sharded)


def _embedding_pre(state: VocabState) -> Callable:
    """The ids as rows of this rank's shard (outside ones: row 0, remembered to be zeroed), the local weight in
    place, ``padding_idx`` moved to its local row (or dropped when another rank holds it)."""

    def hook(module: nn.Embedding, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = args[0] if args else kwargs["input"]
        outside = (ids < state.start) | (ids >= state.end)
        local = (ids - state.start).masked_fill(outside, 0)
        swap_in_local(module, ["weight"])
        module._vocab_call = (outside, module.padding_idx)
        pad = module.padding_idx
        module.padding_idx = pad - state.start if pad is not None and state.start <= pad < state.end else None
        return ((local, *args[1:]), kwargs) if args else (args, {**kwargs, "input": local})

    return hook


def _embedding_post(state: VocabState) -> Callable:
    """The rows other ranks hold zeroed, the partial lookups summed over the TP group (Megatron's g)."""

    def hook(module: nn.Embedding, args: tuple, output: torch.Tensor) -> torch.Tensor:
        swap_back(module)
        outside, module.padding_idx = module._vocab_call
        module._vocab_call = None
        return ReduceFromTP.apply(output.masked_fill(outside.unsqueeze(-1), 0.0), state.group)

    return hook


def _head_pre(state: VocabState) -> Callable:
    """The local columns in place; the input through Megatron's f (its gradient summed over the TP group)."""

    def hook(module: nn.Linear, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        swap_in_local(module, ["weight", "bias"])
        if args:
            return (CopyToTP.apply(args[0], state.group), *args[1:]), kwargs
        return args, {**kwargs, "input": CopyToTP.apply(kwargs["input"], state.group)}

    return hook


def _head_post(state: VocabState) -> Callable:
    """This rank's [..., V/tp] logits as ``VocabLogits`` (or gathered whole, ``gather_logits``)."""

    def hook(module: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        swap_back(module)
        sharded = DTensor.from_local(output, state.mesh, [Shard(output.dim() - 1)], run_check=False)
        if state.gather_logits:
            return sharded.full_tensor()
        return _AsVocabLogits.apply(sharded, state)

    return hook


# ------------------------------------------------------------------------------------------- logits and loss


def _is_shard_last(t: Any) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(t, DTensor) and tuple(t.placements) == (Shard(t.dim() - 1),)


class _AsVocabLogits(torch.autograd.Function):
    """A vocab-sharded DTensor as ``VocabLogits`` (identity: the gradient passes as is)."""

    @staticmethod
    def forward(ctx, logits: Any, state: VocabState) -> Any:
        out = as_dtensor_subclass(VocabLogits, logits)
        out._vocab = state
        return out

    @staticmethod
    def backward(ctx, grad: Any) -> tuple[Any, None]:
        return grad, None


_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
# the steps a token loss takes before the cross-entropy that keep the vocabulary dim last and whole (each checked
# on its result: still Shard(-1))
_KEEP = {torch.Tensor.reshape, torch.Tensor.view, torch.Tensor.float, torch.Tensor.contiguous, torch.Tensor.flatten,
         torch.Tensor.to, torch.Tensor.__getitem__}
# what reads the logits' metadata only (the global shape, dtype, device), and autograd hooks on them (FSDP2's
# pre-backward hook on its root's outputs), which see the gradient as the vocab-sharded DTensor it is
# (torch.distributed.pipelining's stage reads a last stage's outputs' strides and, after their backward, detaches
# them in place where they are no views)
_METADATA = {torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
             torch.Tensor.is_floating_point, torch.Tensor.element_size, torch.Tensor.register_hook,
             torch.Tensor.retain_grad, torch.Tensor._is_view, torch.Tensor.detach_}


class VocabLogits(torch.distributed.tensor.DTensor):
    """The LM head's logits sharded over the TP group by vocabulary (a DTensor ``Shard(-1)``; module doc). Its
    ``__torch_function__`` computes ``F.cross_entropy`` on the shards and keeps the shards through the steps in
    ``_KEEP``; anything else gets the logits gathered whole."""

    _vocab: VocabState

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA or getattr(func, "__name__", "") == "__get__":
            with torch_function_disabled():
                return func(*args, **kwargs)
        state = next(a._vocab for a in tree_flatten((args, kwargs))[0] if isinstance(a, VocabLogits))
        if func is F.cross_entropy:
            loss = _sharded_cross_entropy(args, kwargs)
            if loss is not None:
                return loss
        elif func in _KEEP and _keeps_vocab(func, args, kwargs):
            with torch_function_disabled():
                out = func(*args, **kwargs)
            if _is_shard_last(out):
                return _AsVocabLogits.apply(out, state)
            return _gathered(out, state, _name(func))
        _report(state, _name(func))
        args, kwargs = tree_map(_whole, (args, kwargs))
        return func(*args, **kwargs)


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _keeps_vocab(func: Callable, args: tuple, kwargs: dict) -> bool:
    """``func`` keeps the vocabulary dim whole: ``to`` only casts (no device), ``__getitem__`` only slices."""
    if func is torch.Tensor.to:
        return all(isinstance(a, torch.dtype) for a in (*args[1:], *kwargs.values()))
    if func is torch.Tensor.__getitem__:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return all(isinstance(i, (slice, int)) or i is Ellipsis or i is None for i in index)
    return True


def _gathered(out: Any, state: VocabState, name: str) -> Any:
    """A result of a kept step that is no longer vocab-sharded: whole, with the report line."""
    from torch.distributed.tensor import DTensor

    _report(state, name)
    return out.full_tensor() if isinstance(out, DTensor) else out


def _whole(value: Any) -> Any:
    """``value`` gathered whole where it is ``VocabLogits`` (differentiable), else as it is."""
    if isinstance(value, VocabLogits):
        with torch_function_disabled():
            return value.full_tensor()
    return value


def _report(state: VocabState, name: str) -> None:
    """The one line (once per model, from one rank holding the head: ``VocabState.reporter``) saying the logits
    were gathered."""
    if state.reported:
        return
    state.reported = True
    if state.reporter:
        print(f"autopar: the vocabulary-parallel logits are used by {name}, not the token cross-entropy: gathered "
              "whole over the tp group there (exact; no logits memory saved)", flush=True)


def _sharded_cross_entropy(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.cross_entropy(*args, **kwargs)`` on the vocabulary shards, or None where ``_ShardedCrossEntropy`` does
    not compute it (class weights, label smoothing, probabilities as targets, logits not [N, V])."""
    bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    logits, target = a["input"], a["target"]
    if (not isinstance(logits, VocabLogits) or isinstance(target, VocabLogits) or logits.dim() != 2
            or target.dim() != 1 or target.is_floating_point() or a["weight"] is not None
            or a["size_average"] is not None or a["reduce"] is not None or a["label_smoothing"] != 0.0):
        return None
    with torch_function_disabled():
        local = logits.to_local()  # differentiable: the gradient comes back as the vocab-sharded DTensor
    return _ShardedCrossEntropy.apply(local, target, logits._vocab, int(a["ignore_index"]), a["reduction"])


class _ShardedCrossEntropy(torch.autograd.Function):
    """The token cross-entropy on this rank's vocabulary shard of the logits [N, V/tp] (a plain local tensor; rows
    [start, end) of the vocabulary), Megatron-LM's ``vocab_parallel_cross_entropy`` (Shoeybi et al. 2019): the row
    max, the target's logit and the sum of exponentials reduced over the TP group, computed in fp32 in one working
    buffer that ends as the softmax, saved for backward, where the gradient is made in it in place. Memory: that
    buffer, T*V/tp*4 bytes, besides the input (torch's ``loss_parallel`` holds three fp32 tensors of that size at
    its peak). Returns the loss, the same on every TP rank, reduced as ``reduction`` asks (``mean``: over the
    targets that are not ``ignore_index``, as ``F.cross_entropy``)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, state: VocabState, ignore_index: int,
                reduction: str) -> torch.Tensor:
        import torch.distributed as dist

        work = logits.float()
        if work is logits:  # an fp32 input stays the caller's
            work = logits.clone()
        top = work.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=state.group)
        work.sub_(top.unsqueeze(-1))
        valid = target != ignore_index
        mine = valid & (target >= state.start) & (target < state.end)
        local = (target - state.start).masked_fill(~mine, 0)
        picked = work.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        work.exp_()
        total = work.sum(dim=-1)
        dist.all_reduce(picked, group=state.group)
        dist.all_reduce(total, group=state.group)
        per_token = (total.log() - picked).masked_fill(~valid, 0.0)
        work.div_(total.unsqueeze(-1))  # the softmax, for backward
        ctx.save_for_backward(work, local, mine, valid)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == "none":
            return per_token.to(logits.dtype)
        loss = per_token.sum()
        if reduction == "mean":
            loss = loss / valid.sum()
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Any, None, None, None, None]:
        softmax, local, mine, valid = ctx.saved_tensors
        grad_input = softmax  # in place: the softmax is not needed again
        rows = torch.arange(grad_input.shape[0], device=grad_input.device)
        grad_input[rows, local] -= mine.to(grad_input.dtype)
        scale = grad.float() if ctx.reduction == "none" else grad.float().expand(valid.shape)
        if ctx.reduction == "mean":
            scale = scale / valid.sum()
        grad_input.mul_((scale * valid).unsqueeze(-1))
        return grad_input.to(ctx.dtype), None, None, None, None
