"""Tensor parallelism (Megatron layouts through DTensor), derived from the traced analysis.

Per block: q, k, v (or the MLP's up and gate) are split by columns (each rank owns whole heads / a slice of the
FFN), o and down by rows (partial sums all-reduced), so each block costs two all-reduces forward and two
backward. The projections are addressed by their paths below the block wherever the analysis found them in the
dataflow (HF BERT: q/k/v in ``attention.self``, o in the sibling ``attention.output``, the MLP from
``intermediate.dense`` to ``output.dense``). TP leaves everything outside these projections alone (embeddings, a
ViT's patch Conv2d, CLS token and position embeddings, norms, heads: replicated across the TP group, sharded by
FSDP over the data-parallel mesh only), so no op of the model meets a TP DTensor next to a plain tensor. MoE
experts are split the same way inside each expert; the router stays replicated. Experts stored as fused 3-D
weights (HF Mixtral) too, by ``parallel.tp_experts``. Norms stay replicated across the TP group; the token
embedding and the LM head are sharded by vocabulary right after, by ``parallel.vocab`` (where it applies; else they
stay replicated too).

Where the rest lives: Megatron's f / g and SP's sequence collectives in ``parallel.tp_comm``, row-permuted weights
and their state-dict hooks in ``parallel.row_order``, the FSDP placement and the DCP layout of TP-fused weights in
``parallel.tp_placement``, and every private torch API these use in ``parallel.dtensor_private``.

Separate nn.Linear projections use torch's ``ColwiseParallel`` / ``RowwiseParallel``. Two layouts need their own
style (``LocalShard``), because torch's styles accept only nn.Linear and split a weight into contiguous blocks:

* fused projections (GPT-2's ``c_attn``, litgpt's and nanoGPT's ``qkv``, Phi-3's ``qkv_proj`` and
  ``gate_up_proj``): the model cuts the output into [q | k | v] (or [gate | up]) and then into heads, so TP rank
  r must hold rows r of *each* piece. That is DTensor's ``_StridedShard(dim, split_factor=pieces)``: the global
  tensor stays the single-device one (``full_tensor``, ``get_model_state_dict(full_state_dict=True)``) and the
  local shard is [q_r | k_r | v_r], so the model's own ``split`` works. Layouts interleaved per kv group (a view
  into (groups, q_per_kv + 2, head_dim)) are a plain ``Shard``. A fused bias stays replicated; each rank adds
  its slice and the slices' gradients are summed over the TP group in backward;
* fused [q | k | v] with GQA (litgpt's ``qkv`` with n_query_groups < n_head, Phi-3's GQA ``qkv_proj``): the
  pieces have unequal widths, which no DTensor placement cuts into [q_r | k_r | v_r]. The weight is stored as
  ``Shard`` of a row-permuted global tensor P(W) = [q_0; k_0; v_0; q_1; k_1; v_1; ...] (``RowOrder``), so the
  local rows are the rank's own heads; state dicts, checkpoints and optimizer states show W
  (``parallel.row_order``);
* transposed projections (GPT-2's Conv1D, weight [in, out]): column split is Shard(1) of the weight and Shard(0)
  of the bias, row split Shard(0) of the weight with the bias added once, after the sum.

A ``LocalShard`` module computes with its local shards as plain tensors (its own forward, unchanged), with the
collectives of Megatron's f / g around it. What the model's own code must see divided (a head count, GPT-2's
``split_size``, litgpt's ``config.n_head`` -- litgpt's config is shared, so each attention module gets its own
shallow copy) was found by the analysis's meta dry run (``AttentionInfo.tp_attrs``); when no division lets the
code run on local shapes (nanoGPT's ``view(B, T, n_head, C // n_head)`` with C the full width), ``check_tp``
refuses tp > 1 with that reason.

Sequence parallelism (plan.sp, ``parallel.sequence``): every attention and dense-MLP projection is a ``LocalShard``
with ``sp`` set -- column projections without f (their module gathers the sequence; an nn.Linear or Conv1D one
computes it with ``tp_comm.ColumnFromChunk``, saving this rank's chunk for backward), row projections reduce-scatter
along the sequence (``tp_comm.row_output_sp``) instead of g. Experts keep f and g.

Checkpoints and FSDP on top: ``parallel.tp_placement`` (``plain_shards``, ``restore_layout``, ``fsdp_placement``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.dtensor_private import (own_parameters, parallel_style_base, strided_shard, swap_back,
                                                        swap_in_local)
from lightning_autopar.parallel.row_order import RowOrder, keep_row_order
from lightning_autopar.parallel.tp_comm import (CopyToTP, ReduceFromTP, SeqComm, SliceOfReplicated, keep_chunk_forward,
                                                row_output_sp, sum_grads_post, sum_grads_pre)
from lightning_autopar.parallel.tp_experts import shard_fused_experts
from lightning_autopar.profile.analyze import (AttentionInfo, BlockInfo, MLPInfo, ModelAnalysis, MoEInfo,
                                               divide_attributes, leaf_width_attributes)
from lightning_autopar.profile.records import FUSED_CALL_REFUSAL, FUSED_EXPERT_CALLS

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def check_tp(analysis: ModelAnalysis, tp: int, structure_only: bool = False) -> None:
    """Raise one clear ConfigError when ``tp`` cannot shard this model. ``structure_only``: check only what the
    model's structure allows (the planner's divisibility rules handle head and FFN counts); this includes the
    analysis's meta dry run, so a model whose code cannot run on local heads is never offered tp > 1."""
    if tp == 1:
        return
    spec = analysis.spec
    for block in analysis.blocks:
        attn = block.attention
        if attn is None or attn.o is None or not (attn.q or attn.qkv):
            raise ConfigError("plan.tp", f"{block.fqn}: attention projections not recognised, so tp={tp} cannot "
                              "split it", "use tp=1, or separate q/k/v/o nn.Linear layers")
        if attn.tp_refusal:
            raise ConfigError("plan.tp", _located(block.fqn, attn.tp_refusal), "use tp=1")
        if block.mlp is None and block.moe is None:
            raise ConfigError("plan.tp", f"{block.fqn}: MLP not recognised", "use tp=1")
        if block.mlp is not None and block.mlp.tp_refusal:
            raise ConfigError("plan.tp", _located(block.fqn, block.mlp.tp_refusal), "use tp=1")
        if block.moe is not None and block.moe.expert_mlp is not None and block.moe.expert_mlp.gate_up:
            raise ConfigError("plan.tp", f"{join_path(block.fqn, block.moe.fqn)}: experts with a fused gate/up "
                              f"projection ({block.moe.expert_mlp.gate_up}) are not split by TP", "use tp=1")
        if block.moe is not None and block.moe.fused:
            _check_fused_experts(f"{block.fqn}.{block.moe.fqn}", block.moe, tp if not structure_only else None)
    if structure_only:
        return
    if spec.heads % tp or spec.kv_heads % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide heads={spec.heads} and kv_heads={spec.kv_heads}",
                          f"choose tp among the common divisors of {spec.heads} and {spec.kv_heads}")
    if spec.ffn_hidden % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide ffn_hidden={spec.ffn_hidden}", "choose a divisor")


def _check_fused_experts(fqn: str, moe: MoEInfo, tp: int | None) -> None:
    """Fused 3-D experts are split inside each expert (``FusedExpertsTP``): ``tp`` must divide their FFN width
    (the planner's rules check it for ``ffn_hidden``, so only with ``tp`` given). Their weights' layout is
    checked on the module when applied (``tp_experts.fused_split_dims``, ``tp_experts.probe_fused_split``)."""
    if moe.expert_call not in FUSED_EXPERT_CALLS:
        where = f"{fqn}.{moe.experts}" if moe.experts else fqn
        raise ConfigError("plan.tp", f"{where}: {FUSED_CALL_REFUSAL}, so TP does not split them",
                          "use tp=1")
    if tp is not None and moe.ffn_hidden % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide the experts' ffn width {moe.ffn_hidden} of {fqn}",
                          "choose tp dividing it")


def _located(block_fqn: str, refusal: str) -> str:
    """A refusal "<path in the block>: why" (the path may be empty: the block itself) located in the model."""
    where, _, why = refusal.partition(": ")
    return f"{block_fqn}.{where}: {why}" if where else f"{block_fqn}: {why}"


# ------------------------------------------------------------------------------------------- LocalShard


def piece_index(width: int, pieces: int, tp: int, rank: int) -> torch.Tensor:
    """Indices of rank ``rank``'s part of each of ``pieces`` equal pieces of ``width`` ([q_r | k_r | v_r])."""
    piece = width // pieces
    step = piece // tp
    return torch.cat([torch.arange(p * piece + rank * step, p * piece + (rank + 1) * step) for p in range(pieces)])


@dataclass(frozen=True)
class LocalShardSpec:
    """How one projection is split: ``kind`` "col" (outputs) or "row" (inputs); ``transposed``: weight stored
    [in, out]; ``pieces`` > 1: a fused [a | b | c] output, each rank holding its part of every piece;
    ``widths``: a fused output of pieces with these unequal widths (GQA's [q | k | v]), stored row-permuted."""

    kind: str
    transposed: bool = False
    pieces: int = 1
    widths: tuple[int, ...] = ()
    # sequence parallelism (``parallel.sequence``): the input of a column projection is the sequence gathered by
    # its module (no f: that gather's backward reduce-scatters the partial input gradients); a row projection
    # reduce-scatters its output along the sequence (no g) and adds its bias on this rank's tokens
    sp: bool = False


def _local_style() -> type:
    class LocalShard(parallel_style_base()):
        """Shard a linear-like module's weight (and bias) as ``spec`` says; its forward runs on the local shards
        as plain tensors, between Megatron's f (column) or g (row) collectives. Parameter names are unchanged."""

        def __init__(self, spec: LocalShardSpec) -> None:
            super().__init__()
            self.spec = spec

        def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            spec, tp = self.spec, device_mesh.size()
            out_dim = 1 if spec.transposed else 0
            weight = module.weight
            out_features = weight.shape[out_dim]
            fused = spec.pieces > 1 or bool(spec.widths)
            order = RowOrder(spec.widths, tp, out_dim) if spec.widths else None
            if spec.kind == "col":
                w_place = strided_shard(out_dim, spec.pieces) if spec.pieces > 1 else Shard(out_dim)
                b_place = Replicate() if fused else Shard(0)
                for attr in leaf_width_attributes(module, out_features):
                    setattr(module, attr, getattr(module, attr) // tp)
            else:
                w_place, b_place = Shard(1 - out_dim), Replicate()
            for name, place in (("weight", w_place), ("bias", b_place)):
                param = getattr(module, name, None)
                if isinstance(param, nn.Parameter):
                    value = param
                    if order is not None and name == "weight":
                        value = param.detach().index_select(out_dim, order.permutation().to(param.device))
                    module.register_parameter(name, nn.Parameter(distribute_tensor(value, device_mesh, [place]),
                                                                 requires_grad=param.requires_grad))
            if order is not None:
                keep_row_order(module, order)
            group = device_mesh.get_group()
            bias_index = None
            if spec.kind == "col" and fused and getattr(module, "bias", None) is not None:
                rank = device_mesh.get_local_rank()
                bias_index = order.local_index(rank) if order is not None else \
                    piece_index(out_features, spec.pieces, tp, rank)
            comm = SeqComm(group, tp, device_mesh.get_local_rank()) if spec.sp else None
            if spec.kind == "col" and spec.sp and (type(module) is nn.Linear or (spec.transposed and
                                                                               type(module).__name__ == "Conv1D")):
                keep_chunk_forward(module, spec.transposed)
            module.register_forward_pre_hook(_pre_hook(spec, group, bias_index), with_kwargs=True)
            module.register_forward_hook(_post_hook(spec, group, comm))
            return module

    return LocalShard


def _pre_hook(spec: LocalShardSpec, group: Any, bias_index: torch.Tensor | None) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        params = own_parameters(module)
        bias = swap_in_local(module, ["weight", "bias"]).get("bias")
        if bias is not None:
            local = bias.to_local()
            if spec.kind == "row":  # added once, after the sum (post hook)
                params["bias"] = torch.zeros_like(local).detach()
            elif bias_index is not None:
                params["bias"] = SliceOfReplicated.apply(local, bias_index.to(local.device), group)
            else:
                params["bias"] = local
        if spec.kind == "col" and args and not spec.sp:
            args = (CopyToTP.apply(args[0], group), *args[1:])
        return args, kwargs

    return hook


def _post_hook(spec: LocalShardSpec, group: Any, comm: SeqComm | None) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        swap_back(module)
        if spec.kind != "row":
            return output
        if comm is None:
            output = ReduceFromTP.apply(output, group)
        else:
            output = row_output_sp(output, comm, type(module).__name__)
        bias = own_parameters(module).get("bias")
        if bias is None:
            return output
        # with SP the bias meets only this rank's tokens: its gradient is summed over the TP group (f)
        return output + (bias.to_local() if comm is None else CopyToTP.apply(bias.to_local(), group))

    return hook


# ------------------------------------------------------------------------------------------- layouts


def _style(name: str, kind: str, transposed: set[str], pieces: int = 1, sp: bool = False) -> Any:
    """torch's style for a plain nn.Linear without SP, else ``LocalShard`` (SP needs its sequence collectives)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name not in transposed and pieces == 1 and not sp:
        return ColwiseParallel() if kind == "col" else RowwiseParallel()
    return _local_style()(LocalShardSpec(kind, name in transposed, pieces, sp=sp))


def _mlp_layout(prefix: str, mlp: MLPInfo, sp: bool = False) -> dict:
    """The MLP's projections below ``prefix`` (relative to the block; "" when the MLP spans the block's own
    children, as HF BERT's ``intermediate.dense`` -> ``output.dense``)."""
    join = (lambda n: join_path(prefix, n))
    flipped = set(mlp.transposed)
    layout = {join(mlp.up): _style(mlp.up, "col", flipped, 2 if mlp.gate_up else 1, sp),
              join(mlp.down): _style(mlp.down, "row", flipped, sp=sp)}
    if mlp.gate:
        layout[join(mlp.gate)] = _style(mlp.gate, "col", flipped, sp=sp)
    return layout


def join_path(*names: str) -> str:
    """A module path from parts relative to each other; empty parts (the block itself) drop out."""
    return ".".join(n for n in names if n)


def _attention_layout(attn: AttentionInfo, sp: bool = False) -> dict:
    """The attention's projections relative to the block. ``attn.fqn`` is the innermost module holding all of them,
    which need not be their parent: HF BERT's "attention" with q "self.query" and o "output.dense"."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    flipped = set(attn.transposed)
    if attn.qkv and attn.qkv_layout == "sequential" and len(set(attn.qkv_pieces)) > 1:  # GQA: row-permuted
        layout = {join_path(attn.fqn, attn.qkv): _local_style()(LocalShardSpec("col", attn.qkv in flipped,
                                                                            widths=tuple(attn.qkv_pieces), sp=sp))}
    elif attn.qkv:
        pieces = 3 if attn.qkv_layout == "sequential" else 1
        layout = {join_path(attn.fqn, attn.qkv): _style(attn.qkv, "col", flipped, pieces, sp)}
    else:
        layout = {join_path(attn.fqn, name): _style(name, "col", flipped, sp=sp) for name in (attn.q, attn.k, attn.v)}
    layout[join_path(attn.fqn, attn.o)] = _style(attn.o, "row", flipped, sp=sp)
    for table in attn.head_tables:  # an Embedding [n, heads]: torch's column style shards its heads, output local
        layout[join_path(attn.fqn, table)] = ColwiseParallel()
    return layout


def block_layout(block: BlockInfo, expert_keys: list[str] | None = None, sp: bool = False) -> dict:
    """FQN (relative to the block) -> ParallelStyle for one block. ``sp``: the attention's and the dense MLP's
    projections run between sequence-parallel collectives (``parallel.sequence``); experts keep f and g (the MoE
    module sees the whole sequence). ``expert_keys``: the names of the experts in their container (a ModuleList's
    indices by default; a ModuleDict's keys)."""
    attn = block.attention
    assert attn is not None
    layout = _attention_layout(attn, sp)
    if block.mlp is not None:
        layout.update(_mlp_layout(block.mlp.fqn, block.mlp, sp))
    if block.moe is not None and block.moe.expert_mlp is not None:
        base = f"{block.moe.fqn}.{block.moe.experts}" if block.moe.fqn else block.moe.experts
        keys = [str(e) for e in range(block.moe.num_experts)] if expert_keys is None else expert_keys
        for key in keys:
            layout.update(_mlp_layout(f"{base}.{key}", block.moe.expert_mlp))
    return layout


def shard_head_param(attention: nn.Module, path: str, tp_mesh: DeviceMesh) -> None:
    """A per-head parameter (``AttentionInfo.head_params``: one value per head, GPT-OSS's sinks) sharded along the
    heads (``Shard(0)``, a DTensor under its own name); its module's forward sees this rank's heads as a plain
    tensor, autograd reaching the DTensor (``swap_in_local`` / ``swap_back``)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    owner_path, _, leaf = path.rpartition(".")
    owner = attention.get_submodule(owner_path) if owner_path else attention
    param = getattr(owner, leaf)
    owner.register_parameter(leaf, nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [Shard(0)]),
                                                requires_grad=param.requires_grad))
    names = list(getattr(owner, "_head_param_names", []))
    if not names:  # the first of the module's per-head parameters: its hooks
        owner.register_forward_pre_hook(_local_head_params)
        owner.register_forward_hook(lambda module, args, out: swap_back(module), always_call=True)
    owner._head_param_names = names + [leaf]


def _local_head_params(module: nn.Module, args: tuple) -> None:
    swap_in_local(module, module._head_param_names)


def apply_tensor_parallel(transformer: nn.Module, analysis: ModelAnalysis, tp_mesh: DeviceMesh,
                          sp: bool = False) -> None:
    """Shard every block of ``transformer`` over ``tp_mesh`` in place; parameter names are unchanged. ``sp``: the
    projections' layout for sequence parallelism, whose hooks ``parallel.sequence.apply_sequence_parallel``
    adds."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_tp(analysis, tp)
    if tp == 1:
        return
    for info in analysis.blocks:
        block = transformer.get_submodule(info.fqn)
        expert_keys = None
        if info.moe is not None and not info.moe.fused:
            moe_mod = block.get_submodule(info.moe.fqn) if info.moe.fqn else block
            expert_keys = list(moe_mod.get_submodule(info.moe.experts)._modules)  # a list's indices, a dict's keys
        parallelize_module(block, tp_mesh, block_layout(info, expert_keys, sp))
        attention = block.get_submodule(info.attention.fqn)
        divide_attributes(attention, info.attention.tp_attrs, tp)
        for path in info.attention.head_params:
            shard_head_param(attention, path, tp_mesh)
        for path in info.attention.head_norms:  # one weight for all heads, used here on the local heads only
            norm = attention.get_submodule(path)
            norm.register_forward_pre_hook(sum_grads_pre(tp_mesh.get_group()))
            norm.register_forward_hook(sum_grads_post)
        if info.moe is not None and info.moe.fused:
            moe_mod = block.get_submodule(info.moe.fqn) if info.moe.fqn else block
            shard_fused_experts(moe_mod.get_submodule(info.moe.experts), info.moe, tp_mesh,
                                f"{info.fqn}.{info.moe.fqn}")

