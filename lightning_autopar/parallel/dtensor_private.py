"""Every private torch API the tensor-parallel layouts use (``parallel.tensor``, ``tp_experts``, ``row_order``,
``tp_placement``, ``sequence``, ``experts``, ``vocab``), in one module, each behind a small function.

Checked against torch 2.13.0 (``torch.__version__`` of the project's environment). A torch upgrade that changes
any of these breaks TP here, and nowhere else. ``torch.distributed`` is imported inside the functions: importing
the planner or the profiler must not load it.

* ``torch.distributed.tensor.placement_types._StridedShard`` (``strided_shard``, ``strided_dim``,
  ``plain_placements``): the placement of a fused projection ([q | k | v], [gate | up]) whose TP rank r holds
  rows r of *each* piece, so the global tensor stays the single-device one and the local shard is
  [q_r | k_r | v_r]. No public placement describes it (``Shard`` cuts contiguous blocks). DCP writes a DTensor's
  local shard as one contiguous chunk, which a strided shard is not, so ``plain_placements`` names the plain
  ``Shard`` placements a state dict is redistributed to before a DCP save or load.
* ``ParallelStyle._apply`` (``parallel_style_base``): the abstract method ``parallelize_module`` calls on a style.
  torch's styles accept only nn.Linear and contiguous splits; ``LocalShard`` (fused, row-permuted and transposed
  projections, sequence parallelism) is a style of our own, so it implements this private hook.
* ``nn.Module._parameters`` (``own_parameters``, ``swap_in_local``, ``swap_back``): the live name -> parameter
  table. A module's own forward runs on local shards or on autograd functions of its parameters (a plain tensor
  or a non-leaf in a parameter's place for one call), which ``register_parameter`` and ``setattr`` refuse (a
  parameter's slot takes only an ``nn.Parameter``); writing the table for the call and restoring it after keeps the
  parameters (DTensors, FSDP's) and their names. Used by ``LocalShard``'s hooks, fused 3-D experts (TP hooks,
  the split probe, EP's expert forward) and SP's gradient-summing swap; ``row_order`` reads a module's own
  weight through it (the parameter object itself, whatever FSDP put there).
* ``nn.Module._register_state_dict_hook`` (``register_state_dict_hook``): a row-permuted weight's hook
  (``row_order``) that replaces its entry in the state dict (W instead of P(W)), in place, returning None. Kept
  as it was written; torch's public ``register_state_dict_post_hook`` (same signature, in-place changes only)
  would serve the same hook and is the way to drop this private use.
* ``DeviceMesh._concatenate`` (``concatenate_meshes``): the (ep, tp) mesh of a fused expert weight TP already
  split, from the ep mesh and the weight's tp mesh (``experts``). Public slicing only takes named dims of one
  existing mesh; no public API joins two meshes.
* DTensor's caches keyed by DeviceMesh equality (``clear_sharding_caches``): the C++ dispatch fast path's
  (``torch._C._clear_DTensor_sharding_propagator_cache``), the sharding propagator's ``propagate_op_sharding`` and
  ``_propagate_tensor_meta_cached``, the redistribution planner's ``_gen_transform_infos``,
  ``MeshTopoInfo.build_from_mesh`` and the single-dim strategy cache. A mesh of a new process group equals one of a
  destroyed group when its shape and ranks do, so a cached plan would name groups that no longer resolve; ``autopar
  simulate`` builds a new fake group per simulated rank and clears them.
* ``ShardingPropagator._propagate_tensor_meta_non_cached`` (``propagation_in_own_fake_mode``): on a cache miss
  the propagator runs the op on tensors of the global shapes inside whatever FakeTensorMode is active; ``autopar
  simulate`` gives it one of its own while it measures a step, so its memory tracker does not count them.
* ``DTensor.__new__(cls, local, spec, requires_grad=...)`` and ``DTensor._spec`` (``as_dtensor_subclass``): a
  DTensor subclass instance sharing a DTensor's local tensor and spec (``vocab.VocabLogits``, the vocab-sharded
  logits whose ``__torch_function__`` decides between the sharded loss and a gather). ``from_local`` and
  ``redistribute`` always build the base class; DTensor's own ops and ``from_local`` use this constructor.
* ``torch._C.DisableTorchFunctionSubclass`` (``torch_function_disabled``): runs an op on a subclass instance with
  its ``__torch_function__`` skipped (the pattern torch's subclass docs show; the context lives in ``torch._C``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# ------------------------------------------------------------------------------------------- _StridedShard


def strided_shard(dim: int, pieces: int) -> Any:
    """The placement holding this rank's part of each of ``pieces`` equal pieces along ``dim``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=pieces)


def strided_dim(tensor: Any) -> int | None:
    """The dim of ``tensor``'s strided-shard placement (a DTensor), None when it has none."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return None
    return next((p.dim for p in tensor.placements if isinstance(p, _StridedShard)), None)


def plain_placements(placements: tuple) -> tuple:
    """``placements`` with every strided shard a plain ``Shard`` of the same dim."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)


# ------------------------------------------------------------------------------------------- ParallelStyle._apply


def parallel_style_base() -> type:
    """A ``ParallelStyle`` whose subclasses implement ``apply(module, device_mesh)`` (the private ``_apply``
    ``parallelize_module`` calls)."""
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class ParallelStyleBase(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            return self.apply(module, device_mesh)

        def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            raise NotImplementedError

    return ParallelStyleBase


# ------------------------------------------------------------------------------------------- nn.Module._parameters


def own_parameters(module: nn.Module) -> dict[str, Any]:
    """``module``'s live name -> parameter table (its own parameters, not its children's): writing it swaps a
    tensor in for a call without ``register_parameter``."""
    return module._parameters


def swap_in_local(module: nn.Module, names: list[str]) -> dict[str, Any]:
    """Put the local tensors of ``module``'s DTensor parameters ``names`` in their place for one forward (the
    model's own code then computes on this rank's slice, autograd reaching the DTensors); returns the stash
    ``swap_back`` restores."""
    from torch.distributed.tensor import DTensor

    params = module._parameters
    module._tp_stash = {n: params[n] for n in names if params.get(n) is not None}
    params.update({n: p.to_local() if isinstance(p, DTensor) else p for n, p in module._tp_stash.items()})
    return module._tp_stash


def swap_back(module: nn.Module) -> None:
    """Undo ``swap_in_local``."""
    module._parameters.update(module._tp_stash)
    module._tp_stash = {}


# ------------------------------------------------------------------------------------------- state-dict hook


def register_state_dict_hook(module: nn.Module, hook: Callable[[nn.Module, dict, str, Any], None]) -> None:
    """``hook(module, state_dict, prefix, local_metadata)`` after ``module``'s own entries are in the state dict;
    it may replace their values."""
    module._register_state_dict_hook(hook)


# ------------------------------------------------------------------------------------------- DeviceMesh._concatenate


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """The mesh whose dims are those of ``meshes`` in order (sub-meshes of one world mesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def clear_sharding_caches() -> None:
    """Forget DTensor's cached sharding and redistribution plans (module doc: ``DTensor's caches``); each cache that
    this torch has is cleared."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor._ops import single_dim_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = [getattr(propagator, "propagate_op_sharding", None),
              getattr(propagator, "_propagate_tensor_meta_cached", None),
              getattr(_redistribute, "_gen_transform_infos", None),
              getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
              getattr(single_dim_strategy, "_cached_create_expanded_strategy", None)]
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()


@contextmanager
def propagation_in_own_fake_mode() -> Iterator[None]:
    """While active, DTensor's sharding propagator infers an op's output metadata (it runs the op on tensors of the
    global shapes) under a FakeTensorMode of its own, not the active one, which it otherwise reuses
    (``ShardingPropagator._propagate_tensor_meta_non_cached``): a memory tracker inside a simulation's
    FakeTensorMode then sees only the local ops (MemTracker skips ops under another fake mode), not the global-shape
    tensors of a propagation that a cache miss runs, which no device allocates."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    infer = ShardingPropagator._propagate_tensor_meta_non_cached

    def isolated(self: Any, op_schema: Any) -> Any:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return infer(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = isolated
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = infer


# ------------------------------------------------------------------------------------------- DTensor subclasses


def as_dtensor_subclass(cls: type, dtensor: Any) -> Any:
    """A ``cls`` (a DTensor subclass) instance over ``dtensor``'s local tensor (detached: the caller's autograd
    function links the two) and spec, not requiring grad."""
    return cls(dtensor._local_tensor.detach(), dtensor._spec, requires_grad=False)


def torch_function_disabled() -> Any:
    """The context in which an op on a tensor subclass skips the subclass's ``__torch_function__``."""
    import torch

    return torch._C.DisableTorchFunctionSubclass()
