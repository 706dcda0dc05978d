"""Expert parallelism: the experts of each MoE layer sharded over an ``ep`` group, tokens moved by all-to-all.

EP is carved out of the data-parallel ranks (``ep`` divides ``dp``; Megatron / torchtitan): an EP group is ``ep``
consecutive data-parallel ranks (``topology.mesh.ep_group_ranks``), and rank ``r`` of the group holds experts
``[r * E/ep, (r+1) * E/ep)``. Non-local experts are removed from the expert ``ModuleList`` while the local ones
keep their original indices, so parameter names are the user's (``...mlp.experts.5.up_proj.weight``) and a DCP
checkpoint is the union of the ranks' experts.

Supported MoE layout: a module with a router ``nn.Linear(hidden, E)``, an ``nn.ModuleList`` of E experts and a
``route(x) -> (topk weights, topk expert ids, aux loss)`` method holding the routing math (as
``models.gpt.MoE``); ``route`` may take ``reduce_counts`` (see below). The layer's forward is replaced by:

1. ``route`` on this rank's tokens: the same routing math as on one device;
2. dispatch: assignments sorted by expert, counts exchanged, tokens sent with ``all_to_all_single`` (uneven
   split sizes) to the rank holding their expert;
3. the local experts on the tokens they received (every local expert runs, on zero rows if need be, so all
   ranks reduce the same gradients);
4. combine: the outputs go back with the inverse all-to-all and are summed per token with the router weights.

No token is dropped, so the layer computes exactly what the single-device layer computes. An optional
``capacity_factor`` caps each expert at ``ceil(capacity_factor * tokens * top_k / E)`` assignments per source
rank (in token order); assignments beyond it are dropped (contribute zero), which then differs from one device.

Load-balancing loss over the right tokens. The Switch loss ``E * sum_e f_e * P_e`` (f: fraction of assignments
to expert e, P: mean router probability) is not linear in the tokens, so a data-parallel rank computing it on
its own slice does not reproduce the single-device value. With ``reduce_counts`` the per-expert counts are
all-reduced over the data-parallel group, so f is the fraction over the whole global micro-batch while P stays
this rank's mean: the mean over ranks of ``E * sum_e f_e * P_e,rank`` is then exactly the single-device loss over
the same tokens, and so are its gradients (f carries none). With ``grad_accum > 1`` each micro-batch's loss
covers that micro-batch's tokens across the data-parallel group: equal to one device running the same
micro-batches (as Lightning's own gradient accumulation would).

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

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_autopar.profile.analyze import ModelAnalysis


@dataclass
class ExpertLayer:
    """One MoE layer after EP: where it lives and which experts this rank holds."""

    fqn: str  # of the MoE module, relative to the transformer
    module: nn.Module
    experts: list[nn.Module] = field(default_factory=list)  # local experts, in expert-id order
    first_expert: int = 0


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
        if not callable(getattr(module, "route", None)):
            raise ConfigError("plan.ep", f"{fqn} ({type(module).__name__}) has no route(x) -> (weights, expert ids, "
                              "aux loss) method holding its routing math", "use ep=1, or add route() (see "
                              "lightning_autopar.models.gpt.MoE)")


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


class ExpertParallelForward:
    """Replaces an MoE layer's ``forward`` (an instance attribute, so the module and its names are unchanged)."""

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
        import torch.distributed as dist

        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.count_group)
        return counts

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
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
        import torch.distributed as dist

        E, G = self.num_experts, self.ep
        local = E // G
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
        sent = x[token]
        if G > 1:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
            send_splits = counts.view(G, local).sum(1).tolist()
            recv_splits = recv_counts.view(G, local).sum(1).tolist()
            received = _AllToAll.apply(sent, recv_splits, send_splits, self.ep_group)
            expert_of_row = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(G), recv_counts)
            perm = torch.argsort(expert_of_row, stable=True)
            grouped = received[perm]
            per_expert = recv_counts.view(G, local).sum(0).tolist()
        else:
            grouped, per_expert = sent, counts.tolist()
        outs = [expert(rows) for expert, rows in zip(self.layer.experts, grouped.split(per_expert))]
        y = torch.cat(outs) if outs else grouped
        if G > 1:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel(), device=perm.device)
            y = _AllToAll.apply(y[inverse], send_splits, recv_splits, self.ep_group)
        w = weights.reshape(-1)[order].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y * w[:, None])


def apply_expert_parallel(transformer: nn.Module, analysis: ModelAnalysis, ep_group: ProcessGroup | None,
                          count_group: ProcessGroup | None, capacity_factor: float | None = None) -> list[ExpertLayer]:
    """Shard every MoE layer's experts over ``ep_group`` (None or size 1: all experts stay) and route through
    all-to-all; ``count_group`` (the data-parallel group) makes the balance loss cover the global micro-batch.

    Returns the layers with their local experts (for FSDP over the expert-data-parallel mesh). Layers whose
    module has no ``route`` method are left as they are when ``ep == 1``.
    """
    ep = 1 if ep_group is None else ep_group.size()
    check_ep(analysis, transformer, ep)
    rank = 0 if ep_group is None else ep_group.rank()
    layers = []
    for fqn, module, info in moe_modules(transformer, analysis):
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
