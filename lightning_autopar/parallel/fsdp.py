"""Data parallelism for every zero stage through FSDP2 ``fully_shard``, one unit per block plus the root.

Mapping (FSDP2 has no separate ZeRO-1/2 switches; these are the nearest semantics):

* zero=0 (DDP): ``fully_shard`` on a (dp_replicate=dp, dp_shard=1) mesh: states replicated, gradients
  all-reduced, no parameter gathers.
* zero=1 and zero=2: parameters, gradients and optimizer states sharded over dp_shard, but parameters stay
  gathered from forward to backward (``reshard_after_forward=False``): one all-gather per step and a
  reduce-scatter of gradients, as in ZeRO-2. ZeRO-1 (replicated gradients) is served by the same, which
  never uses more memory.
* zero=3 (FSDP): also reshards after forward, gathering again in backward.

With ``dp_shard < dp`` the mesh is 2-D (HSDP): shard inside groups of ``dp_shard``, replicate across them.
Gradients are averaged over all data-parallel ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.precision import mixed_precision_policy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def data_parallel_units(root: nn.Module, block_fqns: Iterable[str], covered: nn.Module) -> list[nn.Module]:
    """Modules to wrap, innermost first: the blocks, then ``covered`` (the transformer) and any other child of
    ``root`` holding parameters outside it. Parameters directly on ``root`` cannot be wrapped."""
    units = [covered.get_submodule(f) for f in block_fqns]
    direct = [n for n, _ in root.named_parameters(recurse=False)]
    if direct:
        raise ConfigError(f"{type(root).__name__}.{direct[0]}", "a parameter registered directly on the "
                          "LightningModule cannot be sharded", "hold it in a submodule (e.g. an nn.Linear)")
    covered_ids = {id(p) for p in covered.parameters()}
    extra = [m for _, m in root.named_children()
             if m is not covered and any(id(p) not in covered_ids for p in m.parameters())]
    return units + [covered] + extra


def apply_data_parallel(
    root: nn.Module,
    transformer: nn.Module,
    block_fqns: list[str],
    dp_mesh: DeviceMesh,
    zero: int,
    precision: str = "fp32",
) -> list[nn.Module]:
    """``fully_shard`` the blocks, the transformer and leftover children of ``root``; returns the FSDP roots
    (the modules whose gradient sync the strategy toggles for accumulation)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(precision)
    units = data_parallel_units(root, block_fqns, transformer)
    n_blocks = len(block_fqns)
    for i, unit in enumerate(units):
        # the last block is gathered again right away by backward: keeping it saves one all-gather
        reshard = zero == 3 and i < n_blocks - 1
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return units[n_blocks:]


def set_gradient_sync(roots: list[nn.Module], enabled: bool) -> None:
    """Skip (or restore) the gradient reduction: FSDP2 then accumulates unsharded gradients locally."""
    for module in roots:
        module.set_requires_gradient_sync(enabled)
