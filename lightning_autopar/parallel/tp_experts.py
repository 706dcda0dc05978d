"""Tensor parallelism inside fused 3-D experts (HF Mixtral: ``gate_up_proj`` [E, 2*ffn, hidden] fusing
[gate | up] along dim 1, ``down_proj`` [E, hidden, ffn]), which ``parallel.tensor.apply_tensor_parallel`` calls
for an MoE whose experts are stored fused: ``gate_up_proj`` is ``_StridedShard(1, split_factor=2)`` (the rank
keeps its part of gate and of up), ``down_proj`` ``Shard(2)``; the module's own forward runs on the local weights
between f (on its hidden states and routing weights) and g (on its output); a probe on tiny weights checks that
the forward's split sums to the whole before anything is sharded. With EP on top the weights become 2-D DTensors
(``Shard(0)`` on ep, the TP placement on tp; ``parallel.experts``). torchtitan's GroupedExperts (``w1``, ``w3``
[E, ffn, hidden], ``w2`` [E, hidden, ffn], called with the tokens sorted by expert and the count per expert) split
alike: ``w1``/``w3`` ``Shard(1)``, ``w2`` ``Shard(2)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.dtensor_private import own_parameters, strided_shard, swap_back, swap_in_local
from lightning_autopar.parallel.tp_comm import CopyToTP, ReduceFromTP

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autopar.profile.analyze import MoEInfo


def fused_split_dims(experts: nn.Module, moe: MoEInfo, where: str) -> dict[str, tuple[int, int]]:
    """name -> (dim split over TP, pieces) for each fused expert weight: the input projections ([E, out, in],
    read ``hidden``) by their output dim -- in ``pieces`` = 2 (a ``_StridedShard``, so the rank keeps its part of
    gate AND of up) when one weight fuses gate and up, 2 * ffn wide --, the output projection ([E, hidden, ffn])
    by its input dim; transposed weights ([E, in, out], ``is_transposed``) the other way round."""
    flip = bool(getattr(experts, "is_transposed", False))
    out_dim, in_dim = (2, 1) if flip else (1, 2)
    dims = {}
    for name in moe.fused_params:
        param = own_parameters(experts)[name]
        if param.dim() != 3:  # a per-expert bias of the output would be added by every TP rank's partial sum
            raise ConfigError("plan.tp", f"{where}.{name}: fused experts with parameters other than 3-D weights "
                              f"({tuple(param.shape)}) are not split by TP", "use tp=1 (ep and dp shard them)")
        width = param.shape[out_dim]
        if param.shape[in_dim] == moe.ffn_hidden and width != moe.ffn_hidden:
            dims[name] = (in_dim, 1)
        elif width in (moe.ffn_hidden, 2 * moe.ffn_hidden):
            dims[name] = (out_dim, width // moe.ffn_hidden if moe.gated else 1)
        else:
            raise ConfigError("plan.tp", f"{where}.{name}: a fused expert weight of shape {tuple(param.shape)} is "
                              f"neither an input nor the output projection of the {moe.ffn_hidden}-wide experts",
                              "use tp=1")
    return dims


def _local_slice(full: torch.Tensor, dim: int, pieces: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split ``tp`` ways along ``dim``, inside each of its ``pieces`` equal
    pieces (what ``_StridedShard(dim, split_factor=pieces)`` holds locally)."""
    return torch.cat([p.chunk(tp, dim)[rank] for p in full.chunk(pieces, dim)], dim)


def probe_fused_split(experts: nn.Module, moe: MoEInfo, dims: dict[str, tuple[int, int]], tp: int,
                       where: str) -> None:
    """Check from what the experts' forward does (not from names) that the split is exact: on tiny random weights
    (the module's expert count, 4 FFN columns per rank), the sum over ranks of the forward with each rank's
    slices must equal the forward with the whole weights. A forward that cuts a fused gate/up otherwise
    than [gate | up] (interleaved, say) fails here instead of training apart from one device."""
    E, hidden, ffn = moe.num_experts, 4, 4 * tp  # widths of 16 bytes: grouped_mm needs aligned strides
    gen = torch.Generator().manual_seed(0)
    saved = dict(own_parameters(experts))
    shapes = {}
    for name, (dim, pieces) in dims.items():
        shape = list(saved[name].shape)
        shape[dim] = ffn * pieces
        shape[3 - dim] = hidden  # the other non-expert dim
        shapes[name] = shape
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    args = _probe_call(moe, torch.randn(5, hidden, generator=gen), gen)
    try:
        with torch.no_grad():
            own_parameters(experts).update(full)
            want = type(experts).forward(experts, *args)
            got = torch.zeros_like(want)
            for rank in range(tp):
                own_parameters(experts).update({n: _local_slice(full[n], *dims[n], tp, rank) for n in dims})
                got += type(experts).forward(experts, *args)
    except Exception as err:  # noqa: BLE001 -- any failure means the forward does not run on local widths
        why = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError("plan.tp", f"{where}: the fused experts' forward does not run on TP-local widths "
                          f"({type(err).__name__}: {why})", "use tp=1") from err
    finally:
        own_parameters(experts).update(saved)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise ConfigError("plan.tp", f"{where}: the fused experts' forward split over TP ranks does not sum to the "
                          "whole (their fused gate/up is not cut [gate | up])", "use tp=1")


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
        probe_fused_split(experts, moe, fused_split_dims(experts, moe, where), tp, where)


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
    dims = fused_split_dims(experts, moe, where)
    probe_fused_split(experts, moe, dims, tp, where)
    for name, (dim, pieces) in dims.items():
        param = own_parameters(experts)[name]
        place = strided_shard(dim, pieces) if pieces > 1 else Shard(dim)
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [place]),
                                                      requires_grad=param.requires_grad))
    group = tp_mesh.get_group()
    experts.register_forward_pre_hook(_fused_pre_hook(list(dims), group), with_kwargs=True)
    experts.register_forward_hook(_fused_post_hook(group))


def _fused_pre_hook(names: list[str], group: Any) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        swap_in_local(module, names)
        f = (lambda t: CopyToTP.apply(t, group) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    return hook


def _fused_post_hook(group: Any) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor):
        swap_back(module)
        return ReduceFromTP.apply(output, group)

    return hook
