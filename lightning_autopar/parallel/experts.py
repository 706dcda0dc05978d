"""Expert parallelism: the experts of each MoE layer sharded over an ``ep`` group, tokens moved by all-to-all.

EP is carved out of the data-parallel ranks (``ep`` divides ``dp``; Megatron / torchtitan): an EP group is ``ep``
consecutive data-parallel ranks (``topology.mesh.ep_group_ranks``), and rank ``r`` of the group holds experts
``[r * E/ep, (r+1) * E/ep)``. Non-local experts are removed from the expert ``ModuleList`` while the local ones
keep their original indices, so parameter names are the user's (``...mlp.experts.5.up_proj.weight``) and a DCP
checkpoint is the union of the ranks' experts (fused layout: those rows of the 3-D weights, see below).

Supported MoE layouts:

* a module with a router ``nn.Linear(hidden, E)``, an ``nn.ModuleList`` of E experts and a
  ``route(x) -> (topk weights, topk expert ids, aux loss)`` method holding the routing math (as
  ``models.gpt.MoE``); ``route`` may take ``reduce_counts`` (see below). The layer's forward is replaced;
* the fused layout of Hugging Face Mixtral (transformers 5): a router module (``gate``, weight [E, hidden],
  returning (logits, top-k scores, top-k ids)) and an experts module holding 3-D parameters with the experts
  along dim 0 (``gate_up_proj`` [E, 2*ffn, hidden], ``down_proj`` [E, hidden, ffn]). The block's own forward runs
  unchanged (jitter, its ``gate``: the routing math is the user's); only the experts module's forward is
  replaced, by steps 2-4 below with HF's own experts forward (whichever ``experts_implementation``) run on the
  received rows with the local weights. Each expert parameter becomes a DTensor ``Shard(0)`` on the "ep" mesh:
  parameter names and global shapes stay the user's, so DCP checkpoints hold whole tensors and reshard across
  plans. FSDP then shards dim 1 over the expert-data-parallel mesh (``parallel.fsdp.shard_experts``). TP (applied
  before EP, ``parallel.tp_experts.shard_fused_experts``) splits each expert inside: the parameters are then 2-D
  DTensors on the (ep, tp) mesh, and the TP hooks around the experts module wrap this dispatch (its input
  replicated over TP, its output -- partial sums of each token's experts -- all-reduced).
* torchtitan's GroupedExperts: the same 3-D weights (``w1``/``w3`` [E, ffn, hidden], ``w2`` [E, hidden, ffn]),
  called by the block with its tokens already sorted by expert and the count per expert (``experts(x,
  num_tokens_per_expert)``, found from the trace: ``MoEInfo.expert_call`` "grouped"). Its forward is replaced by
  steps 2-3 below on those rows (the block's own routing, weighting and combine run unchanged); the weights are
  DTensors as for Mixtral's, and TP splits them alike. The block's router decides what each expert gets, so
  ``capacity_factor`` does not apply.

* a plain MoE written the usual way: a router ``nn.Linear(hidden, E)``, an ``nn.ModuleList`` of E expert MLPs
  (hidden -> ffn -> hidden, as the analysis classifies them) and the top-k loop over the experts inside the
  layer's ``forward`` (litgpt's ``LLaMAMoE``, Mixtral's reference code). The user's ``forward`` runs unchanged,
  twice per call (``PlainExpertForward``, below).

The forward then does:

1. routing on this rank's tokens: the same routing math as on one device;
2. dispatch: assignments sorted by expert, counts exchanged, tokens sent with ``all_to_all_single`` (uneven
   split sizes) to the rank holding their expert;
3. the local experts on the tokens they received (every local expert runs, on zero rows if need be, so all
   ranks reduce the same gradients);
4. combine: the outputs go back with the inverse all-to-all and are summed per token with the router weights.

No token is dropped, so the layer computes exactly what the single-device layer computes. An optional
``capacity_factor`` caps each expert at ``ceil(capacity_factor * tokens * top_k / E)`` assignments per source
rank (in token order); assignments beyond it are dropped (contribute zero), which then differs from one device.

Plain MoE layers (no ``route``): the expert ``ModuleList`` (or ``ModuleDict``) is replaced by ``ExpertSlots``
(``ExpertSlotsDict``), a container holding
only the local experts under their original indices (names unchanged) whose iteration, ``len`` and indexing give
E call slots instead, so the user's loop still sees every expert. Each call of the layer runs the user's forward
twice with the same random state: in the capture pass each expert call records its input rows (autograd-connected)
and returns zeros of the input's shape (the expert is an MLP from hidden to hidden); then ONE exchange per layer
(steps 2-4 above without the weighting: the rows of each expert, in call order, go to the rank holding it, every
local expert runs on what it received, the outputs come back); in the replay pass each expert call returns its
computed rows, and the routing weights, the combine and anything else the forward computes (a balance loss stored
on the module) come from the user's own code with their gradients. The replay checks that the calls (expert,
input shape) are those of the capture, else raises. Priced by ``planner.cost.moe_replay_time`` (ModelSpec
``moe_replay``). What must hold: the forward is a function of its inputs and the random state (no expert call's
input computed from another expert call's output; buffers the forward updates in place are restored after the
capture pass). A balance loss computed inside the forward covers this rank's tokens: exact under data parallelism
when it is a mean over tokens (a router z-loss); a loss non-linear in the tokens (the Switch loss) is this rank's,
averaged over ranks like the LM loss. With ep=1 the layer keeps its forward.

Load-balancing loss over the right tokens. The Switch loss ``E * sum_e f_e * P_e`` (f: fraction of assignments
to expert e, P: mean router probability) is not linear in the tokens, so a data-parallel rank computing it on
its own slice does not reproduce the single-device value. With ``reduce_counts`` the per-expert counts are
all-reduced over the data-parallel group, so f is the fraction over the whole global micro-batch while P stays
this rank's mean: the mean over ranks of ``E * sum_e f_e * P_e,rank`` is then exactly the single-device loss over
the same tokens, and so are its gradients (f carries none). With ``grad_accum > 1`` each micro-batch's loss
covers that micro-batch's tokens across the data-parallel group: equal to one device running the same
micro-batches (as Lightning's own gradient accumulation would).

Hugging Face Mixtral computes its balance loss outside the layers (``load_balancing_loss_func`` on the router
logits the model records when ``output_router_logits`` is on). With data parallelism each router's first output
(the logits, which the MoE block itself ignores) is replaced in training mode by the autograd-aware all-gather
of the logits over the data-parallel group (``RouterLogitsGather``): every rank computes the single-device loss
of the global micro-batch, the gather's backward sums the ranks' gradients and the data-parallel average
divides them again, so values and gradients are exact (``router_logits`` returned by the model then hold the
global rows). Not in eval mode (each rank's own tokens, no collective), and not when the model is called with
an ``attention_mask`` (the loss masks the rows with it, which only matches this rank's rows): the loss then
covers this rank's tokens, averaged over ranks like the LM loss (a warning says so once).

Gradients: expert weights are sharded / reduced by FSDP over the expert-data-parallel ranks (those holding the
same experts: ``dp / ep`` of them; see ``parallel.fsdp``), divided by the full ``dp`` (every token of the
EP group already contributed to them through the all-to-all backward).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.dtensor_private import concatenate_meshes, own_parameters
from lightning_autopar.parallel.stand_in import stand_in_for
from lightning_autopar.profile.analyze import plain_moe_layout as plain_layout
from lightning_autopar.profile.records import FUSED_CALL_REFUSAL, FUSED_EXPERT_CALLS, _join

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_autopar.profile.analyze import ModelAnalysis


@dataclass
class ExpertLayer:
    """One MoE layer after EP: where it lives and which experts this rank holds."""

    fqn: str  # of the MoE module, relative to the transformer
    module: nn.Module
    experts: list[nn.Module] = field(default_factory=list)  # local experts, in expert-id order (fused: the module)
    first_expert: int = 0
    fused_params: list[str] = field(default_factory=list)  # fused layout: its DTensor parameters (Shard(0) on ep)

    @property
    def fused(self) -> bool:
        return bool(self.fused_params)


def moe_modules(transformer: nn.Module, analysis: ModelAnalysis) -> list[tuple[str, nn.Module, Any]]:
    """(fqn, module, MoEInfo) of every MoE layer the analysis found, among the blocks present in ``transformer``."""
    out = []
    for info in analysis.blocks:
        if info.moe is None:
            continue
        try:
            block = transformer.get_submodule(info.fqn)
        except AttributeError:  # not on this pipeline stage
            continue
        fqn = f"{info.fqn}.{info.moe.fqn}" if info.moe.fqn else info.fqn
        out.append((fqn, block.get_submodule(info.moe.fqn) if info.moe.fqn else block, info.moe))
    return out


def supports_ep(module: nn.Module, info: Any) -> bool:
    """Whether EP can shard this MoE module: the fused layout called as Hugging Face's experts are (tokens, top-k
    ids, weights) or as torchtitan's GroupedExperts (tokens sorted by expert, count per expert), a ``route``
    method holding the routing math, or the plain layout (a router and a ModuleList or ModuleDict of expert
    MLPs, the loop in ``forward``)."""
    if info.fused:  # the dispatch calls the experts as Hugging Face's or torchtitan's are called
        return info.expert_call in FUSED_EXPERT_CALLS
    return callable(getattr(module, "route", None)) or plain_layout(module, info)


def replays_forward(transformer: nn.Module, analysis: ModelAnalysis) -> bool:
    """Whether some MoE layer has the plain layout, whose forward runs twice under ep > 1: the planner's
    ``ModelSpec.moe_replay``, so that cost is priced."""
    return any(plain_layout(module, info) for _, module, info in moe_modules(transformer, analysis))


def _takes_reduce_counts(module: nn.Module) -> bool:
    try:
        return "reduce_counts" in inspect.signature(module.route).parameters
    except (TypeError, ValueError):
        return False


def check_ep(analysis: ModelAnalysis, transformer: nn.Module, ep: int) -> None:
    """Raise one ConfigError when ``ep`` cannot shard this model's experts."""
    if ep == 1:
        return
    layers = moe_modules(transformer, analysis)
    if not layers:
        raise ConfigError("plan.ep", f"ep={ep} needs MoE layers and the analysis found none", "use ep=1")
    for fqn, module, info in layers:
        if info.num_experts % ep:
            raise ConfigError("plan.ep", f"ep={ep} does not divide the {info.num_experts} experts of {fqn}",
                              "choose ep dividing the number of experts")
        if info.fused and not supports_ep(module, info):
            where = f"{fqn}.{info.experts}" if info.experts else fqn
            raise ConfigError("plan.ep", f"{where}: {FUSED_CALL_REFUSAL}, so expert parallelism "
                              "cannot dispatch to them", "use ep=1")
        if not supports_ep(module, info):
            raise ConfigError("plan.ep", f"{fqn} ({type(module).__name__}) has no route(x) -> (weights, expert ids, "
                              "aux loss) method, nor the fused layout (router + 3-D expert weights), nor a router "
                              "next to an nn.ModuleList or nn.ModuleDict of expert MLPs (hidden -> ffn -> hidden)",
                              "use ep=1, or add route() (see lightning_autopar.models.gpt.MoE)")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its backward is the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def gather_rows(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The rows of ``x`` from every rank of ``group``, in rank order (sizes may differ); autograd-aware: the
    backward sums each rank's rows' gradients over the group (an all-to-all of ``x`` copies, its inverse)."""
    import torch.distributed as dist

    size = group.size()
    mine = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(sizes, mine, group=group)
    return _AllToAll.apply(x.repeat(size, *[1] * (x.dim() - 1)), [int(n) for n in sizes], [x.shape[0]] * size,
                           group)


class ExpertParallelForward:
    """Replaces an MoE layer's ``forward`` (an instance attribute, so the module and its names are unchanged)."""

    _stand_in_seen = False  # the last forward outside backward was a stand-in's (parallel.stand_in.stand_in_for)

    def __init__(self, layer: ExpertLayer, num_experts: int, ep_group: ProcessGroup | None,
                 count_group: ProcessGroup | None, capacity_factor: float | None = None) -> None:
        self.layer = layer
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else ep_group.size()
        self.count_group = count_group
        self.capacity_factor = capacity_factor
        self.global_counts = count_group is not None and count_group.size() > 1 and _takes_reduce_counts(layer.module)

    def _reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The expert counts summed over the count group; a zero-weight stand-in's tokens count as none."""
        import torch.distributed as dist

        counts = counts.detach().clone() * (0 if self._stand_in_seen else 1)
        dist.all_reduce(counts, group=self.count_group)
        return counts

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        stand_in_for(self)  # recorded for _reduce_counts (a recomputed forward counts as its original did)
        moe = self.layer.module
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.global_counts:
            weights, ids, aux = moe.route(flat, reduce_counts=self._reduce_counts)
        else:
            weights, ids, aux = moe.route(flat)
        moe.aux_loss = aux
        return self.dispatch(flat, weights, ids).reshape(shape)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(token), the experts living on the EP group."""
        E = self.num_experts
        k = ids.shape[-1]
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=E)
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * flat_ids.numel() / E)
            sorted_ids = flat_ids[order]
            starts = torch.cumsum(counts, 0) - counts
            keep = torch.arange(order.numel(), device=x.device) - starts[sorted_ids] < cap
            order = order[keep]
            counts = torch.bincount(flat_ids[order], minlength=E)
        token = order // k
        y = self.exchange(x[token], counts)
        w = weights.reshape(-1)[order].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y * w[:, None])

    def exchange(self, sent: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The expert outputs of ``sent`` (rows grouped by global expert id, ``counts[e]`` rows for expert e), in
        the same order: rows to the ranks holding their experts, the local experts on them, outputs back."""
        import torch.distributed as dist

        E, G = self.num_experts, self.ep
        local = E // G
        if G > 1:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
            send_splits = counts.view(G, local).sum(1).tolist()
            recv_splits = recv_counts.view(G, local).sum(1).tolist()
            received = _AllToAll.apply(sent, recv_splits, send_splits, self.ep_group)
            expert_of_row = torch.repeat_interleave(torch.arange(local, device=sent.device).repeat(G), recv_counts)
            perm = torch.argsort(expert_of_row, stable=True)
            grouped = received[perm]
            per_expert = recv_counts.view(G, local).sum(0).tolist()
        else:
            grouped, per_expert = sent, counts.tolist()
        y = self.run_experts(grouped, per_expert)
        if G > 1:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel(), device=perm.device)
            y = _AllToAll.apply(y[inverse], send_splits, recv_splits, self.ep_group)
        return y

    def run_experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """The local experts on ``rows`` (grouped by local expert, ``per_expert`` rows each)."""
        outs = [expert(part) for expert, part in zip(self.layer.experts, rows.split(per_expert))]
        return torch.cat(outs) if outs else rows


class FusedExpertsForward(ExpertParallelForward):
    """Replaces a fused experts module's ``forward(hidden_states, top_k_index, top_k_weights)``: the block routed
    with its own gate; tokens go to the ranks holding their experts and through HF's own experts forward there."""

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.dispatch(hidden_states, top_k_weights, top_k_index)

    def run_experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """The module's own forward with its local weights (``local_call``), each row routed to its local expert
        with weight 1 (k=1)."""
        def call(module: nn.Module) -> torch.Tensor:
            ids = torch.repeat_interleave(torch.arange(len(per_expert), device=rows.device),
                                          torch.tensor(per_expert, device=rows.device))[:, None]
            return type(module).forward(module, rows, ids, torch.ones(ids.shape, dtype=rows.dtype,
                                                                      device=rows.device))

        return self.local_call(rows, len(per_expert), call)

    def local_call(self, rows: torch.Tensor, local_experts: int, call: Any) -> torch.Tensor:
        """``call(module)`` with the experts module holding only this rank's experts: the DTensors' local shards
        swapped in for the call and ``num_experts`` (where the module keeps one) set to ``local_experts``.
        With no rows received the forward is skipped and the weights still join the graph (zero gradients)."""
        from torch.distributed.tensor import DTensor

        module = self.layer.experts[0]
        weights = {n: own_parameters(module)[n] for n in self.layer.fused_params}
        local = {n: w.to_local() if isinstance(w, DTensor) else w for n, w in weights.items()}
        if rows.shape[0] == 0:
            return rows + sum(t.sum() for t in local.values()) * 0
        count = getattr(module, "num_experts", None)
        try:
            own_parameters(module).update(local)
            if count is not None:
                module.num_experts = local_experts
            return call(module)
        finally:
            own_parameters(module).update(weights)
            if count is not None:
                module.num_experts = count


class GroupedExpertsForward(FusedExpertsForward):
    """Replaces a fused experts module's ``forward(tokens, num_tokens_per_expert)`` (torchtitan's GroupedExperts:
    the block's router sorted the tokens by expert and counted them): the rows go to the ranks holding their
    experts (``exchange``: its contract is this call's) and through the module's own forward there, with the
    count per local expert in the dtype the user's counts have."""

    def __call__(self, tokens: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        self.count_dtype = num_tokens_per_expert.dtype
        return self.exchange(tokens, num_tokens_per_expert.to(torch.long))

    def run_experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        counts = torch.tensor(per_expert, dtype=self.count_dtype, device=rows.device)
        return self.local_call(rows, len(per_expert), lambda module: type(module).forward(module, rows, counts))


class _RandomState:
    """The CPU and (if any) accelerator random state, so the replay pass draws what the capture pass drew."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.device = device if device.type not in ("cpu", "meta") else None
        self.accelerator = None
        if self.device is not None:
            self.accelerator = torch.get_device_module(self.device.type).get_rng_state(self.device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.get_device_module(self.device.type).set_rng_state(self.accelerator, self.device)


class _LayerBuffers:
    """The MoE layer's own buffers (not its experts'), to undo in-place updates or rebinding by the capture pass,
    which would otherwise happen twice per call."""

    def __init__(self, module: nn.Module, experts: list[nn.Module]) -> None:
        skip = {id(b) for e in experts for b in e.buffers()}
        self.saved = []
        for name, buf in module.named_buffers():
            if id(buf) not in skip:
                prefix, _, leaf = name.rpartition(".")
                self.saved.append((module.get_submodule(prefix), leaf, buf, buf.detach().clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for owner, leaf, buf, value in self.saved:
                if owner._buffers.get(leaf) is not buf:
                    owner._buffers[leaf] = buf
                if not torch.equal(buf, value):  # an unchanged buffer keeps its version (saved for backward)
                    buf.copy_(value)


class _ExpertCall:
    """Expert ``index`` as the user's forward sees it (an ``ExpertSlots`` entry): captured or replayed by the
    layer's ``PlainExpertForward``. Not a module, so it holds no parameters."""

    def __init__(self, owner: PlainExpertForward, index: int) -> None:
        self.owner, self.index = owner, index

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.owner.expert_call(self.index, x, args, kwargs)

    def __repr__(self) -> str:
        return f"ExpertCall({self.owner.layer.fqn}, expert {self.index})"


class ExpertSlots(nn.ModuleList):
    """A plain MoE's experts ModuleList under EP: it holds the local experts under their original indices, so
    parameter names and state dicts are the user's; iterating, ``len`` and indexing (what the user's forward
    does) give one call slot per expert of the whole layer, each routed by ``PlainExpertForward``."""

    def __init__(self, items: list[tuple[str, nn.Module]], calls: list[_ExpertCall]) -> None:
        super().__init__()
        for key, module in items:
            self.add_module(key, module)
        self.calls = calls  # plain objects: not in _modules, so not in names, state dicts or FSDP units

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Any:
        return iter(self.calls)

    def __getitem__(self, idx: int | slice) -> Any:  # type: ignore[override]
        return self.calls[idx]

    __repr__ = nn.Module.__repr__  # the local experts, under their names


class ExpertSlotsDict(nn.ModuleDict):
    """``ExpertSlots`` for experts kept in an ``nn.ModuleDict``: the local experts under their keys; indexing by
    key, ``keys``, ``values``, ``items``, iteration, ``in`` and ``len`` give every expert of the layer."""

    def __init__(self, items: list[tuple[str, nn.Module]], keys: list[str], calls: list[_ExpertCall]) -> None:
        super().__init__()
        for key, module in items:
            self.add_module(key, module)
        self.slots = dict(zip(keys, calls))  # plain objects: not in _modules (see ExpertSlots)

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Any:
        return iter(self.slots)

    def __contains__(self, key: object) -> bool:
        return key in self.slots

    def __getitem__(self, key: str) -> Any:  # type: ignore[override]
        return self.slots[key]

    def keys(self) -> Any:  # type: ignore[override]
        return self.slots.keys()

    def values(self) -> Any:  # type: ignore[override]
        return self.slots.values()

    def items(self) -> Any:  # type: ignore[override]
        return self.slots.items()

    __repr__ = nn.Module.__repr__


def experts_always_used(transformer: nn.Module, analysis: ModelAnalysis) -> None:
    """Every trainable expert parameter of a plain MoE layer (experts as modules, called or skipped by the user's
    forward) takes a gradient in every forward, as zero where no token was routed to it: the layer's output gets
    ``0 * sum(p.sum())`` over its experts' parameters added (the same values, exactly). Why: DDP reduces a bucket
    once every parameter in it has a gradient, FSDP reduce-scatters the parameters with one; an expert that one
    rank's micro-batch skips (Switch Transformers calls only the experts hit, a capacity drops tokens) would
    leave the ranks reducing different tensors (a collective mismatch). Expert parallelism needs none of it: its
    exchange calls every local expert, on no rows where none came."""
    for block in analysis.blocks:
        if block.moe is None or block.moe.fused:
            continue
        layer = transformer.get_submodule(_join(block.fqn, block.moe.fqn))
        layer.register_forward_hook(lambda module, args, out, path=block.moe.experts: _touched(module, path, out))


def _touched(layer: nn.Module, experts: str, out: Any) -> Any:
    params = [p for p in layer.get_submodule(experts).parameters() if p.requires_grad]
    first = out if isinstance(out, torch.Tensor) else next(
        (t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)), None)
    if not params or first is None or not first.is_floating_point() or not torch.is_grad_enabled():
        return out
    from torch.distributed.tensor import DTensor

    # a tensor-parallel expert's shard: its local part (the gradient is the DTensor's, on that part)
    zero = torch.stack([(p.to_local() if isinstance(p, DTensor) else p).sum() for p in params]).sum()
    zero = zero.to(first.dtype) * 0.0
    if isinstance(out, torch.Tensor):
        return out + zero
    index = next(i for i, t in enumerate(out) if t is first)
    return type(out)([*out[:index], first + zero, *out[index + 1:]]) if isinstance(out, list) else \
        (*out[:index], first + zero, *out[index + 1:])


_DISPATCHING: dict[tuple[type, type], type] = {}


def _keep_dispatch(container: nn.Module, slots: nn.Module) -> None:
    """A container with a forward of its own (Switch Transformers' experts: called with the tokens and a dispatch
    mask, it calls each expert hit) keeps it on its slots: the slots' class gains the container class's forward,
    and the slots the container's plain attributes (``num_experts``, ...), so the user's dispatch runs over every
    expert's call slot."""
    own = type(container).forward
    if own is nn.Module.forward:
        return
    key = (type(slots), type(container))
    if key not in _DISPATCHING:
        _DISPATCHING[key] = type(f"{type(container).__name__}Slots", (type(slots),),
                                 {"forward": own, "__module__": __name__})
    slots.__class__ = _DISPATCHING[key]
    for name, value in vars(container).items():
        if not name.startswith("_") and name != "training":
            slots.__dict__.setdefault(name, value)


class PlainExpertForward(ExpertParallelForward):
    """Replaces a plain MoE layer's ``forward`` (no ``route``; see the module doc): the user's forward runs
    twice with the same random state, the expert calls of the first recorded, exchanged once and their outputs
    returned in the second."""

    def __init__(self, layer: ExpertLayer, num_experts: int, ep_group: ProcessGroup | None,
                 forward: Any) -> None:
        super().__init__(layer, num_experts, ep_group, None)
        self.user_forward = forward
        self.phase = "idle"  # capture | replay while the user's forward runs
        self.calls: list[tuple[int, torch.Tensor]] = []  # (expert, input rows) in call order
        self.outputs: list[torch.Tensor] = []
        self.cursor = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        probe = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if probe is None:
            raise ConfigError("plan.ep", f"{self.layer.fqn} was called without a tensor input", "use ep=1")
        before = _RandomState(probe.device)
        buffers = _LayerBuffers(self.layer.module, self.layer.experts)
        self.calls = []
        self._run("capture", args, kwargs)
        buffers.restore()
        self.outputs = self.run_calls(probe)
        after = _RandomState(probe.device)
        before.restore()
        self.cursor = 0
        try:
            out = self._run("replay", args, kwargs)
            if self.cursor != len(self.calls):
                raise self._mismatch(f"{len(self.calls)} expert calls captured, {self.cursor} replayed")
        finally:
            self.calls, self.outputs = [], []
        after.restore()
        return out

    def _run(self, phase: str, args: tuple, kwargs: dict) -> Any:
        self.phase = phase
        try:
            return self.user_forward(*args, **kwargs)
        finally:
            self.phase = "idle"

    def _mismatch(self, what: str) -> ConfigError:
        return ConfigError("plan.ep", f"{self.layer.fqn}: the replayed forward called its experts differently "
                           f"from the captured one ({what}); expert parallelism of a plain MoE needs a forward "
                           "that is a function of its inputs and the random state", "use ep=1")

    def expert_call(self, index: int, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """What expert ``index`` returns for ``x`` in the current pass."""
        if args or kwargs or not isinstance(x, torch.Tensor):
            raise ConfigError("plan.ep", f"{self.layer.fqn}: expert {index} is called with more than its input "
                              "rows, which expert parallelism cannot send to the rank holding it", "use ep=1")
        if self.phase == "capture":
            self.calls.append((index, x))
            return x.new_zeros(x.shape)  # an MLP from hidden to hidden: the output has the input's shape
        if self.phase == "replay":
            if self.cursor >= len(self.calls):
                raise self._mismatch(f"more than the {len(self.calls)} calls captured")
            captured, rows = self.calls[self.cursor]
            if captured != index or rows.shape != x.shape:
                raise self._mismatch(f"call {self.cursor}: expert {index} on {tuple(x.shape)}, captured expert "
                                     f"{captured} on {tuple(rows.shape)}")
            self.cursor += 1
            return self.outputs[self.cursor - 1]
        raise ConfigError("plan.ep", f"{self.layer.fqn}: expert {index} was called outside the layer's forward; "
                          "under expert parallelism it may live on another rank",
                          "call the experts only inside the MoE layer's forward, or use ep=1")

    def run_calls(self, probe: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of the captured calls (in call order): their rows grouped by expert (call order within
        an expert), one exchange, split back per call."""
        width = probe.shape[-1]
        if any(rows.shape[-1] != width for _, rows in self.calls):
            raise ConfigError("plan.ep", f"{self.layer.fqn}: an expert is called on rows {width} wide not matching "
                              "the layer's input width", "use ep=1")
        order = sorted(range(len(self.calls)), key=lambda i: self.calls[i][0])
        flat = [self.calls[i][1].reshape(-1, width) for i in order]
        sent = torch.cat(flat) if flat else probe.new_zeros((0, width))
        counts = [0] * self.num_experts
        for part, i in zip(flat, order):
            counts[self.calls[i][0]] += part.shape[0]
        y = self.exchange(sent, torch.tensor(counts, device=probe.device))
        outputs: list[torch.Tensor] = [y] * len(self.calls)
        for part, i in zip(y.split([t.shape[0] for t in flat]), order):
            outputs[i] = part.reshape(*self.calls[i][1].shape[:-1], y.shape[-1])
        return outputs


def apply_plain_expert_parallel(fqn: str, module: nn.Module, info: Any, ep_group: ProcessGroup | None) -> ExpertLayer:
    """Shard a plain MoE layer's experts over ``ep_group`` (None: one rank holding all, the same capture /
    exchange / replay path): the experts ModuleList becomes ``ExpertSlots`` (a ModuleDict ``ExpertSlotsDict``),
    the forward ``PlainExpertForward``."""
    ep = 1 if ep_group is None else ep_group.size()
    rank = 0 if ep_group is None else ep_group.rank()
    container = module.get_submodule(info.experts)
    items = list(container._modules.items())
    per_rank = len(items) // ep
    mine = items[rank * per_rank:(rank + 1) * per_rank]
    layer = ExpertLayer(fqn=fqn, module=module, experts=[m for _, m in mine], first_expert=rank * per_rank)
    forward = PlainExpertForward(layer, len(items), ep_group, module.forward)
    calls = [_ExpertCall(forward, e) for e in range(len(items))]
    slots = (ExpertSlotsDict(mine, [key for key, _ in items], calls) if isinstance(container, nn.ModuleDict)
             else ExpertSlots(mine, calls))
    _keep_dispatch(container, slots)
    parent, _, leaf = info.experts.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, slots)
    module.forward = forward
    return layer


class RouterLogitsGather:
    """Exact Hugging Face balance loss under data parallelism (see the module doc): the routers' first output
    becomes the all-gather of the logits over ``group`` while the transformer runs a training forward that
    records router logits without an ``attention_mask``."""

    def __init__(self, transformer: nn.Module, group: ProcessGroup) -> None:
        self.group = group
        self.active = False
        self.warned = False
        names = list(inspect.signature(transformer.forward).parameters)
        self.mask_position = names.index("attention_mask") if "attention_mask" in names else None
        transformer.register_forward_pre_hook(self._before, with_kwargs=True)
        transformer.register_forward_hook(self._after, with_kwargs=True, always_call=True)

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        config = getattr(module, "config", None)
        recording = kwargs.get("output_router_logits", getattr(config, "output_router_logits", False))
        mask = kwargs.get("attention_mask")
        if mask is None and self.mask_position is not None and len(args) > self.mask_position:
            mask = args[self.mask_position]
        self.active = bool(module.training and recording and mask is None)
        if module.training and recording and mask is not None and not self.warned:
            import warnings

            self.warned = True
            warnings.warn("autopar: the model got an attention_mask, so each data-parallel rank's load-balancing "
                          "loss covers its own tokens (averaged over ranks) instead of the global micro-batch's "
                          "(lightning_autopar.parallel.experts)", stacklevel=2)

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.active = False

    def wrap(self, router: nn.Module) -> None:
        """Replace ``router``'s forward (an instance attribute) by one gathering its first output when active."""
        forward = router.forward

        def gathered(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            if not self.active:
                return out
            rows = out[0][:0] if stand_in_for(self) else out[0]  # a stand-in's tokens route nothing
            return (gather_rows(rows, self.group), *out[1:])

        router.forward = gathered


def _shard_fused(module: nn.Module, names: list[str], first: int, count: int, ep_mesh: Any) -> None:
    """Each parameter ``names`` of ``module`` becomes a DTensor ``Shard(0)`` on ``ep_mesh`` (this rank's rows
    ``[first, first + count)``, the same on every rank since the strategy broadcast the model). A parameter TP
    already split (a DTensor on the "tp" mesh, ``parallel.tp_experts.shard_fused_experts``) becomes a 2-D DTensor on
    the (ep, tp) mesh: ``Shard(0)`` on ep, its TP placement on tp; the global tensor stays the single-device one."""
    from torch.distributed.tensor import DTensor, Shard

    with torch.no_grad():
        for name in names:
            full = own_parameters(module)[name]
            if isinstance(full, DTensor):
                local = full.to_local()[first:first + count].clone()
                mesh = concatenate_meshes([ep_mesh, full.device_mesh])
                sharded = DTensor.from_local(local, mesh, [Shard(0), *full.placements], run_check=False,
                                             shape=full.shape, stride=full.stride())
            else:
                local = full.detach()[first:first + count].clone()
                sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=full.requires_grad))


def apply_expert_parallel(transformer: nn.Module, analysis: ModelAnalysis, ep_group: ProcessGroup | None,
                          count_group: ProcessGroup | None, capacity_factor: float | None = None,
                          ep_mesh: Any = None) -> list[ExpertLayer]:
    """Shard every MoE layer's experts over ``ep_group`` (None or size 1: all experts stay) and route through
    all-to-all; ``count_group`` (the data-parallel group) makes the balance loss cover the global micro-batch.
    The fused layout needs ``ep_mesh`` (the DeviceMesh of ``ep_group``) when ep > 1.

    Returns the layers with their local experts (for FSDP over the expert-data-parallel mesh). With ``ep == 1``
    layers whose module has no ``route`` method keep their forward (fused layout: only the router logits are
    gathered for the balance loss, see ``RouterLogitsGather``; plain layout: nothing changes). ``capacity_factor``
    applies to the ``route`` and fused layouts; a plain layer's own loop decides what each expert gets.
    """
    ep = 1 if ep_group is None else ep_group.size()
    check_ep(analysis, transformer, ep)
    rank = 0 if ep_group is None else ep_group.rank()
    layers = []
    gather = None
    for fqn, module, info in moe_modules(transformer, analysis):
        if info.fused:
            if count_group is not None and count_group.size() > 1 and hasattr(
                    getattr(transformer, "config", None), "output_router_logits"):
                gather = gather or RouterLogitsGather(transformer, count_group)
                gather.wrap(module.get_submodule(info.router))
            if ep == 1:
                continue
            if ep_mesh is None:
                raise ValueError("the fused expert layout needs the ep DeviceMesh (ep_mesh)")
            experts = module.get_submodule(info.experts)
            per_rank = info.num_experts // ep
            _shard_fused(experts, info.fused_params, rank * per_rank, per_rank, ep_mesh)
            layer = ExpertLayer(fqn=fqn, module=module, experts=[experts], first_expert=rank * per_rank,
                                fused_params=list(info.fused_params))
            dispatch = GroupedExpertsForward if info.expert_call == "grouped" else FusedExpertsForward
            experts.forward = dispatch(layer, info.num_experts, ep_group, None, capacity_factor)
            layers.append(layer)
            continue
        if plain_layout(module, info):
            if ep > 1:  # with ep=1 the user's forward stays (its balance loss covers this rank's tokens)
                layers.append(apply_plain_expert_parallel(fqn, module, info, ep_group))
            continue
        if not callable(getattr(module, "route", None)):
            continue
        container = module.get_submodule(info.experts)
        items = list(container._modules.items())
        per_rank = len(items) // ep
        first = rank * per_rank
        mine = items[first:first + per_rank]
        if ep > 1:
            from lightning_autopar.parallel.pipeline import StageBlocks

            parent, _, leaf = info.experts.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, leaf, StageBlocks(mine))
        layer = ExpertLayer(fqn=fqn, module=module, experts=[m for _, m in mine], first_expert=first)
        module.forward = ExpertParallelForward(layer, len(items), ep_group if ep > 1 else None, count_group,
                                               capacity_factor)
        layers.append(layer)
    return layers
