"""Data parallelism: DDP's bucketed all-reduce for plain data parallelism, FSDP2 ``fully_shard`` (one unit per
block plus the modules owning the rest) for every other case.

The units come from ``parallel.units.choose_units``: modules the model's forward actually runs (never a
ModuleDict / ModuleList), each tied parameter owned by one unit enclosing all its uses (GPT-2's tied
``lm_head`` / ``wte``: the ``GPT2LMHeadModel``), as few units as correct for what the blocks leave. Parameter
names are unchanged.

Mapping (FSDP2 has no separate ZeRO-1/2 switches; these are the nearest semantics):

* zero=0 (DDP), data parallelism alone (no tp, pp, ep, cp; no MoE layers): ``replicate`` (composable DDP, as
  torchtitan's DDP): gradients all-reduced in flat buckets overlapping backward, parameters plain tensors
  (names unchanged), compute precision from Lightning's autocast. Measured faster than FSDP2 on a replicate
  mesh (benchmarks/overhead.py). MoE models stay on FSDP2: DDP requires every parameter to get a gradient.
* zero=0 composed with tp / pp / ep: ``fully_shard`` on a (dp_replicate=dp, dp_shard=1) mesh: states
  replicated, gradients all-reduced, no parameter gathers.
* zero=1 and zero=2: parameters, gradients and optimizer states sharded over dp_shard, but parameters stay
  gathered from forward to backward (``reshard_after_forward=False``): one all-gather per step and a
  reduce-scatter of gradients, as in ZeRO-2. ZeRO-1 (replicated gradients) is served by the same, which
  never uses more memory.
* zero=3 (FSDP): also reshards after forward, gathering again in backward.

With ``dp_shard < dp`` the mesh is 2-D (HSDP): shard inside groups of ``dp_shard``, replicate across them.
Gradients are averaged over all data-parallel ranks.

Context parallelism (``parallel.context``): the units shard over the dp x cp ranks (``dp_shard_cp``, as
torchtitan), gradients summed over cp (each cp rank's are its tokens' part) and divided by ``dp`` only; with
zero=0 that mesh is (dp, cp): states sharded over cp, kept gathered from forward to backward.

Expert parallelism: each local expert (fused layout: the experts module, its DTensor parameters sharded on dim
1) is its own unit on the expert-data-parallel mesh (the ``dp / ep`` ranks holding the same experts), wrapped
before its block so the block's unit leaves its parameters alone; its gradients are summed over that mesh and
divided by the full ``dp`` (tokens from the whole EP group reached them through the all-to-all). Pipeline
parallelism: one set of units per pipeline chunk (its blocks, then the chunk for its embeddings / norm / head),
the chunk being what the pipeline schedule drives.

Offload (``plan.offload=params``): every ``fully_shard`` above gets ``offload_policy`` (FSDP2's
``CPUOffloadPolicy``, ``parallel.offload.fsdp_offload_policy``): the shards, their gradients and the optimizer
step on the host.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from torch import nn

from lightning_autopar.parallel.precision import mixed_precision_policy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_autopar.parallel.units import UnitChoice


def _expert_placement(shard_size: int):
    """FSDP's placement for a parameter of the fused expert layout (a DTensor with the experts along dim 0,
    ``Shard(0)`` on the "ep" mesh): dim 1 (the next free dim when TP splits dim 1), so the shardings compose
    without strided sharding (as torchtitan does); FSDP's default (dim 0) when none divides evenly, or for plain
    parameters."""
    from torch.distributed.tensor import DTensor, Shard

    def place(param: nn.Parameter):
        if not isinstance(param, DTensor):
            return None
        taken = {getattr(p, "dim", None) for p in param.placements}  # ep's dim 0, a TP split (fused experts)
        return next((Shard(d) for d in range(1, param.dim()) if d not in taken and param.shape[d] % shard_size == 0),
                    None)

    return place


def shard_experts(experts: Iterable[nn.Module], edp_mesh: DeviceMesh, zero: int, dp: int,
                  precision: str = "fp32", offload_policy: Any = None) -> None:
    """One FSDP unit per local expert (fused layout: per experts module) on the expert-data-parallel mesh,
    gradients divided by ``dp``; ``offload_policy``: FSDP2's (None: its default, no offload)."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(precision)
    place = _expert_placement(edp_mesh.mesh.shape[-1])
    for expert in experts:
        fully_shard(expert, mesh=edp_mesh, reshard_after_forward=zero == 3, mp_policy=policy,
                    shard_placement_fn=place, **_offload(offload_policy))
        expert.set_gradient_divide_factor(float(dp))
        if edp_mesh.mesh.shape[-1] > 1:
            # a real reduce-scatter: plain SUM, then divide (gloo has no PREMUL_SUM). With a shard group of
            # one FSDP divides while copying and must not divide again after the (SUM) all-reduce.
            expert.set_force_sum_reduction_for_comms(True)


def keep_hf_output_recording(modules: Iterable[nn.Module]) -> None:
    """``fully_shard`` and ``replicate`` swap a module's class for a subclass (``FSDPMixtralModel``); Hugging Face looks up what a
    model records (router logits -- hence Mixtral's balance loss --, hidden states, attentions) by class name, so
    a wrapped model would silently record nothing: register the new classes too."""
    import sys

    capturing = sys.modules.get("transformers.utils.output_capturing")
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None:
        return
    for module in modules:
        recordable = getattr(module, "_can_record_outputs", None)
        if recordable and not registry.get(module):
            registry[module] = recordable


def _offload(offload_policy: Any) -> dict[str, Any]:
    """``fully_shard``'s offload keyword: none for None (FSDP2's default policy)."""
    return {} if offload_policy is None else {"offload_policy": offload_policy}


def _shard_units(units: list[nn.Module], n_blocks: int, dp_mesh: DeviceMesh, zero: int, precision: str,
                 divide: int | None = None, offload_policy: Any = None) -> None:
    """``fully_shard`` each unit; ``divide``: gradients summed over the mesh, then divided by it (not the mesh
    size) -- context parallelism's dp x cp mesh, summed over cp, averaged over dp. ``offload_policy``: see
    ``shard_experts``."""
    from torch.distributed.fsdp import fully_shard

    from lightning_autopar.parallel.tp_placement import fsdp_placement

    policy = mixed_precision_policy(precision)
    place = fsdp_placement(dp_mesh.mesh.shape[-1])  # TP-fused projections: shard the other dim (parallel.tp_placement)
    for i, unit in enumerate(units):
        # the last block is gathered again right away by backward: keeping it saves one all-gather
        reshard = zero == 3 and i < n_blocks - 1
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, shard_placement_fn=place,
                    **_offload(offload_policy))
        if divide is not None:
            unit.set_gradient_divide_factor(float(divide))
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM then divide (gloo has no PREMUL_SUM)
    keep_hf_output_recording(units)


def apply_data_parallel(root: nn.Module, units: UnitChoice, dp_mesh: DeviceMesh, zero: int,
                        precision: str = "fp32", divide: int | None = None,
                        offload_policy: Any = None) -> list[nn.Module]:
    """``fully_shard`` the chosen units of ``root``, blocks first; returns the units owning what the blocks leave
    plus any FSDP module outside them (the roots: what the strategy toggles gradient sync on, recursively, for
    accumulation). Experts sharded by ``shard_experts`` before this call keep their own units. ``divide``,
    ``offload_policy``: see ``_shard_units``."""
    modules = units.modules(root)
    _shard_units(modules, len(units.blocks), dp_mesh, zero, precision, divide, offload_policy)
    rest = modules[len(units.blocks):]
    inside = {id(m) for unit in rest for m in unit.modules()}
    return rest + [m for m in synced_modules(root) if id(m) not in inside]


def apply_replicate(root: nn.Module, units: UnitChoice, dp_group: ProcessGroup,
                    bucket_mb: float = 25.0, find_unused: bool = False) -> list[nn.Module]:
    """zero=0 for data parallelism alone: composable ``replicate`` (DDP) on the chosen units (chosen without
    blocks: the modules the user's step calls); returns them (their gradient sync is what the strategy toggles
    for accumulation). Buffers are not re-broadcast every forward: every rank starts from rank 0's state and a
    decoder's buffers (RoPE tables, masks) never change. ``find_unused``: the trace shows trainable parameters
    the forward never uses (``ModelAnalysis.unused_params``): DDP then looks for them every step, which it
    otherwise waits for forever ("Expected to have finished reduction in the prior iteration")."""
    from torch.distributed._composable.replicate import replicate

    modules = units.modules(root)
    for unit in modules:
        replicate(unit, process_group=dp_group, bucket_cap_mb=bucket_mb, broadcast_buffers=False,
                  gradient_as_bucket_view=False, find_unused_parameters=find_unused)
    keep_hf_output_recording(modules)
    return modules


def apply_data_parallel_chunks(chunks: Iterable[nn.Module], dp_mesh: DeviceMesh, zero: int,
                               precision: str = "fp32", divide: int | None = None,
                               offload_policy: Any = None) -> list[nn.Module]:
    """Pipeline parallelism: ``fully_shard`` each chunk's blocks, then the chunk (``parallel.pipeline``);
    returns the chunks. ``divide``, ``offload_policy``: see ``_shard_units``."""
    chunks = list(chunks)
    for chunk in chunks:
        blocks = list(chunk.blocks)
        _shard_units(blocks + [chunk], len(blocks), dp_mesh, zero, precision, divide, offload_policy)
    return chunks


def set_gradient_sync(roots: list[nn.Module], enabled: bool) -> None:
    """Skip (or restore) the gradient reduction: FSDP2 then accumulates unsharded gradients locally, DDP in
    ``.grad``. While it is skipped, units that keep their parameters from forward to backward (zero 1/2: no
    reshard after forward) also keep them after backward, so the next micro-batch does not gather them again:
    one all-gather per step, as ZeRO-1/2 (zero 3 still gathers per micro-batch, to keep its memory)."""
    from torch.distributed.fsdp import FSDPModule

    for module in roots:
        module.set_requires_gradient_sync(enabled)
        for unit in module.modules():
            if isinstance(unit, FSDPModule) and not _reshards_after_forward(unit):
                unit.set_reshard_after_backward(enabled, recurse=False)


@contextmanager
def gradient_sync_off(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """While active (``enabled``), the FSDP2 / ``replicate`` modules under ``module`` skip their gradient reduction
    (``set_gradient_sync``): a loop's ``no_sync`` / ``no_backward_sync`` for any plan autopar applied."""
    modules = synced_modules(module) if enabled else []
    set_gradient_sync(modules, False)
    try:
        yield
    finally:
        set_gradient_sync(modules, True)


def _reshards_after_forward(unit: nn.Module) -> bool:
    """Whether an FSDP2 unit frees its gathered parameters after forward (``reshard_after_forward=True``)."""
    groups = unit._get_fsdp_state()._fsdp_param_groups
    return any(group.post_forward_mesh_info is not None for group in groups)


def synced_modules(module: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 / ``replicate`` modules under ``module`` (``set_requires_gradient_sync`` recurses)."""
    from torch.distributed._composable.replicate import DDP
    from torch.distributed.fsdp import FSDPModule

    found: list[nn.Module] = []
    inner: set[int] = set()
    for m in module.modules():
        if id(m) not in inner and isinstance(m, (FSDPModule, DDP)):
            found.append(m)
            inner.update(id(sub) for sub in m.modules())
    return found
