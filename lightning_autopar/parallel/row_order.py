"""Row-permuted TP weights (``RowOrder``): a fused [q | k | v] with GQA's unequal widths is stored as ``Shard`` of
the row-permuted global tensor P(W), so each TP rank's local rows are its own heads (``parallel.tensor``'s
``LocalShard``). Everything elementwise or blind to row order (optimizer steps, norms for clipping, FSDP's cut of
the input dim on top) is unaffected; only the names -> values views show W instead: the module's state-dict hooks
(``state_dict``, ``get_model_state_dict``, DCP) and the optimizer's (its states, ``keep_optimizer_row_order``),
which gather the TP dim, un-permute and return W replicated over TP (loading does the reverse)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.dtensor_private import own_parameters, register_state_dict_hook
from lightning_autopar.parallel.tp_placement import redistribute


@dataclass(frozen=True)
class RowOrder:
    """The permutation that lets ``Shard(dim)`` give each TP rank its own part of every piece of a fused output
    whose pieces have unequal ``widths``: the stored global tensor is P(W) = W.index_select(dim, permutation()),
    the rank chunks [a_0; b_0; c_0; a_1; b_1; c_1; ...], each ``width // tp`` rows of every piece."""

    widths: tuple[int, ...]
    tp: int
    dim: int

    def local_index(self, rank: int) -> torch.Tensor:
        """Rows of W that TP rank ``rank`` holds, in its local order [a_r; b_r; c_r]."""
        starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
        return torch.cat([torch.arange(start + rank * (w // self.tp), start + (rank + 1) * (w // self.tp))
                          for start, w in zip(starts, self.widths)])

    def permutation(self) -> torch.Tensor:
        return torch.cat([self.local_index(r) for r in range(self.tp)])

    def inverse(self) -> torch.Tensor:
        return torch.argsort(self.permutation())


def keep_row_order(module: nn.Module, order: RowOrder) -> None:
    """Make every names -> values view of ``module.weight`` (stored as P(W)) show W: state-dict hooks on the
    module (optimizers holding the weight get theirs from ``keep_optimizer_row_order``). FSDP later replaces the
    parameter object, so the order is kept on the module; the attribute on the parameter tells
    ``fsdp_placement`` which dim it must leave alone."""
    module._autopar_row_order = order
    module.weight._autopar_row_order = order
    register_state_dict_hook(module, _weight_as_single_device)
    module.register_load_state_dict_pre_hook(_weight_from_single_device)


def _tp_mesh_dim(param: Any, order: RowOrder) -> int:
    """The mesh dim of ``param`` (a DTensor, maybe also FSDP-sharded) holding the row-permuted TP shard: the only
    one with a plain ``Shard(order.dim)`` (``fsdp_placement`` shards another dim)."""
    from torch.distributed.tensor import Shard

    dims = [i for i, p in enumerate(param.placements) if type(p) is Shard and p.dim == order.dim]
    if len(dims) != 1:
        raise ConfigError("plan.tp", f"a row-permuted fused weight has placements {param.placements}: no single "
                          f"TP shard of dim {order.dim}", "use tp=1 for this model")
    return dims[0]


def _rows_taken_over_tp(value: Any, order: RowOrder, like: Any, rows: torch.Tensor) -> Any:
    """``value`` (a DTensor on ``like``'s mesh) replicated over the TP mesh dim, other mesh dims as they were, with
    its rows along ``order.dim`` taken in the order ``rows``."""
    from torch.distributed.tensor import DTensor, Replicate

    placements = list(value.placements)
    placements[_tp_mesh_dim(like, order)] = Replicate()
    gathered = redistribute(value, tuple(placements))
    local = gathered.to_local()
    local = local.index_select(order.dim, rows.to(local.device))
    return DTensor.from_local(local, value.device_mesh, gathered.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def to_single_device_order(value: Any, order: RowOrder, like: Any) -> Any:
    """``value`` (laid out like ``like``, the parameter: TP shard of P(W)) as a DTensor of W replicated over the
    TP mesh dim, other mesh dims as they were; what state dicts and checkpoints hold."""
    return _rows_taken_over_tp(value, order, like, order.inverse())


def to_row_order(value: Any, order: RowOrder, like: Any) -> Any:
    """The inverse of ``to_single_device_order``: W (a DTensor of any placements on ``like``'s mesh, or a plain
    full tensor on every rank) laid out like ``like`` (the parameter), holding P(W)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, DTensor):
        permuted = value.index_select(order.dim, order.permutation().to(value.device))
        return distribute_tensor(permuted, like.device_mesh, like.placements)
    return redistribute(_rows_taken_over_tp(value, order, like, order.permutation()), like.placements)


def _weight_as_single_device(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    from torch.distributed.tensor import DTensor

    key, param = prefix + "weight", own_parameters(module).get("weight")
    if isinstance(state_dict.get(key), DTensor) and isinstance(param, DTensor):
        state_dict[key] = to_single_device_order(state_dict[key], module._autopar_row_order, param)


def _weight_from_single_device(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    from torch.distributed.tensor import DTensor

    key, param = prefix + "weight", own_parameters(module).get("weight")
    if isinstance(state_dict.get(key), torch.Tensor) and isinstance(param, DTensor) \
            and state_dict[key].shape == param.shape:
        state_dict[key] = to_row_order(state_dict[key], module._autopar_row_order, param)


def _row_ordered_params(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[int, tuple[RowOrder, Any]]:
    """id(parameter) -> (its row order, the parameter) for the row-permuted weights of ``model`` that
    ``optimizer`` steps."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    found = {}
    for module in model.modules():
        if getattr(module, "_autopar_row_order", None) is None:
            continue
        param = own_parameters(module).get("weight")
        if param is not None and id(param) in stepped:
            found[id(param)] = (module._autopar_row_order, param)
    return found


def _convert_optimizer_states(optimizer: torch.optim.Optimizer, state_dict: dict, convert: Callable,
                              model: nn.Module) -> dict:
    """``state_dict`` (an optimizer state dict keyed by index or name) with the states of row-permuted weights
    passed through ``convert(value, order, param)``; the optimizer's live states are left alone."""
    from torch.distributed.tensor import DTensor

    ordered = _row_ordered_params(optimizer, model)
    if not ordered or "state" not in state_dict:
        return state_dict
    states = dict(state_dict["state"])
    for saved, group in zip(state_dict.get("param_groups", []), optimizer.param_groups):
        for key, param in zip(saved["params"], group["params"]):
            if id(param) not in ordered or key not in states:
                continue
            order, like = ordered[id(param)]
            states[key] = {name: convert(v, order, like) if isinstance(v, DTensor) and v.shape == like.shape else v
                           for name, v in states[key].items()}
    return {**state_dict, "state": states}


def keep_optimizer_row_order(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """An optimizer holding a row-permuted weight (``RowOrder``: its states are P(W)-ordered too) gets state-dict
    hooks that show (and take) its states in W's order, so optimizer checkpoints reshard across plans. Called by
    the strategies on the optimizers built on the sharded parameters; a no-op for any other optimizer."""
    if not _row_ordered_params(optimizer, model):
        return
    optimizer.register_state_dict_post_hook(
        lambda opt, state: _convert_optimizer_states(opt, state, to_single_device_order, model))
    optimizer.register_load_state_dict_pre_hook(
        lambda opt, state: _convert_optimizer_states(opt, state, to_row_order, model))
