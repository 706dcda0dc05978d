"""Tensor parallelism inside fused 3-D experts (HF Mixtral: ``gate_up_proj`` [E, 2*ffn, hidden] fusing
[gate | up] along dim 1, ``down_proj`` [E, hidden, ffn]), which ``parallel.tensor.apply_tensor_parallel`` calls
for an MoE whose experts are stored fused: ``gate_up_proj`` is ``_StridedShard(1, split_factor=2)`` (the rank
keeps its part of gate and of up), ``down_proj`` ``Shard(2)``; the module's own forward runs on the local weights
between f (on its hidden states and routing weights) and g (on its output); a probe on tiny weights checks that
the forward's split sums to the whole before anything is sharded. With EP on top the weights become 2-D DTensors
(``Shard(0)`` on ep, the TP placement on tp; ``parallel.experts``). torchtitan's GroupedExperts (``w1``, ``w3``
[E, ffn, hidden], ``w2`` [E, hidden, ffn], called with the tokens sorted by expert and the count per expert) split
alike: ``w1``/``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``. GPT-OSS's experts ([E, hidden, 2*ffn] with gate and up
interleaved, [E, ffn, hidden], a bias of each) split on their FFN side contiguously (a gate next to its up), the
input bias with its weight, and the output bias is added by TP rank 0 only (``FusedSplit.once``). Which cut of a
fused gate/up is exact is what the probe on the module's own forward says (``choose_fused_split``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.dtensor_private import own_parameters, strided_shard, swap_back, swap_in_local
from lightning_autopar.parallel.tp_comm import CopyToTP, ReduceFromTP

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autopar.profile.analyze import MoEInfo


@dataclass(frozen=True)
class FusedSplit:
    """How TP splits a fused experts module: ``dims`` name -> (dim split over TP, pieces: a ``_StridedShard``
    factor, 1 for a contiguous split) for the weights and their input biases; ``once``: the output biases
    ([E, hidden], GPT-OSS's ``down_proj_bias``), which only TP rank 0 adds to its partial sum (the sum over ranks
    then adds them once), their gradient summed over the TP group."""

    dims: dict[str, tuple[int, int]]
    once: tuple[str, ...] = ()


def fused_split_dims(experts: nn.Module, moe: MoEInfo, where: str, interleaved: bool = False) -> FusedSplit:
    """How to split each fused expert parameter over TP: a 3-D weight along its FFN side (the dim ``ffn`` or
    ``2 * ffn`` wide: Mixtral's [E, 2*ffn, hidden] and [E, hidden, ffn], GPT-OSS's [E, hidden, 2*ffn] and
    [E, ffn, hidden]; where the sizes cannot tell, by ``is_transposed``), a fused gate and up in 2 pieces (a
    ``_StridedShard``: the rank keeps its part of gate AND of up) or, ``interleaved`` (GPT-OSS's ``[..., ::2]``,
    ``[..., 1::2]``: a gate and its up side by side), contiguously; a 2-D input bias [E, (2*)ffn] as its weight;
    a 2-D output bias [E, hidden] added once (``FusedSplit.once``)."""
    flip = bool(getattr(experts, "is_transposed", False))
    ffn = moe.ffn_hidden
    widths = (ffn, 2 * ffn)
    dims: dict[str, tuple[int, int]] = {}
    once: list[str] = []
    hidden = _hidden_of(experts, moe)

    def pieces(width: int) -> int:
        return 1 if interleaved or not moe.gated else width // ffn

    for name in moe.fused_params:
        param = own_parameters(experts)[name]
        shape = tuple(param.shape)
        if param.dim() == 2:
            if shape[1] in widths and shape[1] != hidden:
                dims[name] = (1, pieces(shape[1]))
                continue
            if shape[1] == hidden and shape[1] not in widths:
                once.append(name)
                continue
        elif param.dim() == 3:
            sides = [d for d in (1, 2) if shape[d] in widths]
            if len(sides) != 1:  # hidden = ffn or 2 * ffn: the layout says which side is the FFN's
                out_dim, in_dim = (2, 1) if flip else (1, 2)
                sides = [in_dim] if shape[in_dim] == ffn and shape[out_dim] != ffn else \
                    [out_dim] if shape[out_dim] in widths else []
            if sides:
                dims[name] = (sides[0], pieces(shape[sides[0]]))
                continue
        raise ConfigError("plan.tp", f"{where}.{name}: a fused expert parameter of shape {shape} is neither a "
                          f"projection of the {ffn}-wide experts nor a bias of one", "use tp=1 (ep and dp shard "
                          "them)")
    return FusedSplit(dims, tuple(once))


def _hidden_of(experts: nn.Module, moe: MoEInfo) -> int:
    """The experts' model width: the non-FFN side of their first 3-D weight (0 without one)."""
    for name in moe.fused_params:
        shape = tuple(own_parameters(experts)[name].shape)
        if len(shape) == 3:
            other = [shape[d] for d in (1, 2) if shape[d] not in (moe.ffn_hidden, 2 * moe.ffn_hidden)]
            if len(other) == 1:
                return other[0]
    return 0


def _local_slice(full: torch.Tensor, dim: int, pieces: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split ``tp`` ways along ``dim``, inside each of its ``pieces`` equal
    pieces (what ``_StridedShard(dim, split_factor=pieces)`` holds locally)."""
    return torch.cat([p.chunk(tp, dim)[rank] for p in full.chunk(pieces, dim)], dim)


def probe_fused_split(experts: nn.Module, moe: MoEInfo, split: FusedSplit, tp: int, where: str) -> None:
    """Check from what the experts' forward does (not from names) that the split is exact: on tiny random weights
    (the module's expert count, 4 FFN columns per rank), the sum over ranks of the forward with each rank's
    slices (the output biases on rank 0 only) must equal the forward with the whole weights. A forward that cuts
    a fused gate/up otherwise than the split assumes fails here instead of training apart from one device."""
    E, hidden, ffn = moe.num_experts, 4, 4 * tp  # widths of 16 bytes: grouped_mm needs aligned strides
    gen = torch.Generator().manual_seed(0)
    saved = dict(own_parameters(experts))
    shapes = {}
    for name, (dim, _) in split.dims.items():
        shape = list(saved[name].shape)
        shape[dim] = ffn * (shape[dim] // moe.ffn_hidden)
        if len(shape) == 3:
            shape[3 - dim] = hidden  # the other non-expert dim
        shapes[name] = shape
    shapes.update({name: [E, hidden] for name in split.once})
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    args = _probe_call(moe, torch.randn(5, hidden, generator=gen), gen)
    try:
        with torch.no_grad():
            own_parameters(experts).update(full)
            want = type(experts).forward(experts, *args)
            got = torch.zeros_like(want)
            for rank in range(tp):
                own_parameters(experts).update({n: _local_slice(full[n], *split.dims[n], tp, rank)
                                                for n in split.dims})
                own_parameters(experts).update({n: full[n] if rank == 0 else torch.zeros_like(full[n])
                                                for n in split.once})
                got += type(experts).forward(experts, *args)
    except Exception as err:  # noqa: BLE001 -- any failure means the forward does not run on local widths
        why = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError("plan.tp", f"{where}: the fused experts' forward does not run on TP-local widths "
                          f"({type(err).__name__}: {why})", "use tp=1") from err
    finally:
        own_parameters(experts).update(saved)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise ConfigError("plan.tp", f"{where}: the fused experts' forward split over TP ranks does not sum to the "
                          "whole (their fused gate/up is cut neither [gate | up] nor interleaved)", "use tp=1")


def choose_fused_split(experts: nn.Module, moe: MoEInfo, tp: int, where: str) -> FusedSplit:
    """The split whose probe the experts' forward passes: a fused gate/up as [gate | up] (Mixtral), else
    interleaved (GPT-OSS); one ConfigError (the [gate | up] probe's) when neither is exact."""
    split = fused_split_dims(experts, moe, where)
    try:
        probe_fused_split(experts, moe, split, tp, where)
        return split
    except ConfigError as err:
        first = err
    if not moe.gated:
        raise first
    interleaved = fused_split_dims(experts, moe, where, interleaved=True)
    try:
        probe_fused_split(experts, moe, interleaved, tp, where)
    except ConfigError:
        raise first from None
    return interleaved


def _probe_call(moe: MoEInfo, rows: torch.Tensor, gen: torch.Generator) -> tuple:
    """The probe's arguments for the experts' call (``MoEInfo.expert_call``): Hugging Face's (tokens, top-2
    expert ids, weights), or torchtitan's (tokens sorted by expert, count per expert)."""
    E, n = moe.num_experts, rows.shape[0]
    if moe.expert_call == "grouped":
        return rows, torch.bincount(torch.arange(n) % E, minlength=E)
    return rows, torch.stack([torch.arange(n) % E, (torch.arange(n) + 1) % E], 1), torch.rand(n, 2, generator=gen)


def check_fused_experts_tp(transformer: nn.Module, blocks: list[Any], tp: int) -> None:
    """What ``shard_fused_experts`` refuses on each fused experts module of ``blocks`` (``BlockInfo``s of
    ``transformer``), before any plan is priced: a parameter TP cannot split, a layout it does not recognise, a
    [gate | up] cut the module's forward does not make."""
    for block in blocks:
        moe = block.moe
        if moe is None or not moe.fused:
            continue
        where = f"{block.fqn}.{moe.fqn}".rstrip(".")
        layer = transformer.get_submodule(where)
        experts = layer.get_submodule(moe.experts) if moe.experts else layer
        choose_fused_split(experts, moe, tp, where)


def shard_fused_experts(experts: nn.Module, moe: MoEInfo, tp_mesh: DeviceMesh, where: str) -> None:
    """Megatron's split inside each expert of a fused 3-D experts module: input projections by output features
    (a fused [gate | up] as ``_StridedShard(1, split_factor=2)``, so the global tensor stays the single-device
    one), the output projection by input features (``Shard(2)``); the router stays replicated. The module's own
    forward (whichever ``experts_implementation``: all read the weights' shapes) runs on the local weights,
    between Megatron's f on its floating inputs (hidden states and routing weights: each rank's partial output
    contributes part of their gradients) and g on its output (a partial sum). Hooks, not a new forward, so expert
    parallelism (which replaces the forward) and FSDP (whose hooks wrap these) compose with it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp = tp_mesh.size()
    split = choose_fused_split(experts, moe, tp, where)
    for name, (dim, pieces) in split.dims.items():
        param = own_parameters(experts)[name]
        place = strided_shard(dim, pieces) if pieces > 1 else Shard(dim)
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [place]),
                                                      requires_grad=param.requires_grad))
    group = tp_mesh.get_group()
    experts.register_forward_pre_hook(_fused_pre_hook(list(split.dims), split.once, group, tp_mesh.get_local_rank()),
                                      with_kwargs=True)
    experts.register_forward_hook(_fused_post_hook(group))


def _fused_pre_hook(names: list[str], once: tuple[str, ...], group: Any, tp_rank: int) -> Callable:
    """This rank's slices in place of the split parameters; the output biases as ``CopyToTP`` of them (their
    gradient summed over the TP group), zeroed but on TP rank 0 (added once to the ranks' sum)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        swap_in_local(module, [*names, *once])
        params = module._parameters
        for name in once:
            local = CopyToTP.apply(params[name], group)
            params[name] = local if tp_rank == 0 else local * 0
        f = (lambda t: CopyToTP.apply(t, group) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    return hook


def _fused_post_hook(group: Any) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        swap_back(module)
        return ReduceFromTP.apply(output, group)

    return hook
