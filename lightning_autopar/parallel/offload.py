"""Offload (``plan.offload``, issue 17): model states this rank shards kept in host memory.

``offload=params``: FSDP2's ``CPUOffloadPolicy`` on every ``fully_shard`` the plan makes (``parallel.fsdp``):
the sharded parameters and their gradients live on the host, each unit's shard is copied host-to-device before
its all-gather and its reduce-scattered gradient copied device-to-host, and the optimizer steps the host shards
(its states are made beside them, on the host). FSDP2 requires the sharded parameters to be on the CPU when
``fully_shard`` runs (``FSDPParamGroup._validate_cpu_offload_params``), so the model is not moved to the
device afterwards: only its buffers are (``module_to_device``). Pinned memory only where the device is CUDA.

On a CPU device (torch 2.13, read in ``torch/distributed/fsdp/_fully_shard``) FSDP2 accepts the policy as is:
the host is the device, the shard's ``.to(device)`` before the all-gather and the gradient's ``.to("cpu")``
after the reduce-scatter are identity, the foreach copy fast path is skipped (one copy per parameter instead),
and nothing is pinned. So the same code path runs and trains exactly as without offload.

``offload=optimizer`` (ZeRO-Offload, Ren et al. 2021): parameters and gradients stay on the device; the
optimizer steps host mirrors of this rank's parameter shards (``HostStep``): at each step the gradients are
copied device-to-host, the optimizer runs on the mirrors (its states are made, and kept, on the host) and the
updated shards are copied host-to-device. The optimizer keeps the model's parameters in its param groups and
its states keyed by them outside the step, so Lightning's loop, gradient clipping and the fp16 scaler (which
act on the device gradients before the step), ``get_optimizer_state_dict(model, optimizer)`` (keys: the
model's parameter names) and sharded checkpoints across offload on/off work unchanged. On a CPU device the
mirrors are separate tensors in the same memory: the copies run, so the bookkeeping is what one device tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lightning_autopar.errors import ConfigError


def fsdp_offload_policy(offload: str, device: torch.device) -> Any:
    """The ``offload_policy`` for ``fully_shard``: ``CPUOffloadPolicy`` for offload=params (pinned on CUDA), else
    FSDP2's default (no offload)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if offload == "params":
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return OffloadPolicy()


def module_to_device(module: nn.Module, device: torch.device, offload: str) -> None:
    """Move ``module`` to ``device`` as the strategies do after apply; with offload=params only its buffers (the
    parameters are the host shards FSDP2 offloads, and must stay on the CPU)."""
    if offload != "params" or device.type == "cpu":
        module.to(device)
        return
    for sub in module.modules():
        for key, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[key] = buffer.to(device)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard, or ``t``)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _host_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor shaped as ``t`` (same DTensor mesh and placements: the optimizer's states
    made from it are DTensors like the device parameter's, so state dicts reshard as without offload)."""
    from torch.distributed.tensor import DTensor

    local = torch.empty_like(_local(t), device="cpu", pin_memory=pin)
    if isinstance(t, DTensor):
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return local


@dataclass
class _Mirror:
    """The host copy of one device parameter: ``host`` (what the optimizer steps), its gradient buffer, and the
    device shard's tensor and version when they were last equal (a change outside the step -- a checkpoint
    load, the user's own in-place edit -- is copied in again before the next step)."""

    host: nn.Parameter
    grad: torch.Tensor
    source: torch.Tensor | None = None
    version: int = -1


class HostStep:
    """Runs ``optimizer``'s step on host mirrors of its parameters (offload=optimizer; see the module doc).

    The step is wrapped on the instance: a closure (Lightning's: training step, backward, clipping) runs first,
    on the device, then the gradients go to the host, the original step runs there, and the parameters come
    back. An optimizer that evaluates its closure more than once per step cannot be served (it must see the
    parameters it changes): torch's LBFGS is refused; others raise at their first step, since their closure is
    not passed to them."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ConfigError("plan.offload", "offload=optimizer steps on host copies of the parameters, and LBFGS "
                              "re-evaluates its closure on the parameters it changes within a step",
                              "use offload=none or offload=params with LBFGS")
        self.optimizer = optimizer
        self.pin = device.type == "cuda"
        self.mirrors: dict[int, _Mirror] = {}
        self._step: Callable[..., Any] = optimizer.step
        optimizer.step = self.step  # type: ignore[method-assign]

    def host_copies(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameter mirrors, gradient buffers) this step holds on the host: what a memory measurement started
        between steps must be told about (``profile.memory`` asks the optimizer's step owner for them)."""
        mirrors = list(self.mirrors.values())
        return [m.host for m in mirrors], [m.grad for m in mirrors]

    @torch.no_grad()
    def _mirror(self, p: torch.Tensor) -> _Mirror:
        """``p``'s mirror, its values copied in if the device shard changed since the last step."""
        m = self.mirrors.get(id(p))
        if m is None:
            m = self.mirrors[id(p)] = _Mirror(nn.Parameter(_host_like(p, self.pin)), _host_like(p, self.pin))
        local = _local(p)
        if m.source is not local or m.version != local._version:
            _local(m.host).copy_(local)
            m.source, m.version = local, local._version
        return m

    @torch.no_grad()
    def _to_host(self) -> dict[int, torch.Tensor]:
        """Swap the param groups and states to the mirrors, gradients copied D2H; returns mirror id -> device
        parameter, to swap back."""
        opt = self.optimizer
        back: dict[int, torch.Tensor] = {}
        for group in opt.param_groups:
            hosted = []
            for p in group["params"]:
                m = self._mirror(p)
                if p.grad is None:
                    m.host.grad = None
                else:
                    _local(m.grad).copy_(_local(p.grad))
                    m.host.grad = m.grad
                back[id(m.host)] = p
                hosted.append(m.host)
            group["params"] = hosted
        state = opt.state
        for p in list(state):
            if id(p) in self.mirrors:
                moved = {k: _to_cpu(v) for k, v in state.pop(p).items()}  # after a load: states made on the device
                state[self.mirrors[id(p)].host] = moved
        return back

    @torch.no_grad()
    def _to_device(self, back: dict[int, torch.Tensor]) -> None:
        """Copy the stepped mirrors H2D and give the optimizer its device parameters back."""
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = [back.get(id(h), h) for h in group["params"]]
        for h in [h for h in opt.state if id(h) in back]:
            opt.state[back[id(h)]] = opt.state.pop(h)
        for hid, p in back.items():
            m = self.mirrors[id(p)]
            local = _local(p)
            local.copy_(_local(m.host), non_blocking=self.pin)  # pinned source: ordered before the device's use
            m.host.grad = None
            m.source, m.version = local, local._version

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The closure (if any) on the device, then the optimizer's own step on the host mirrors."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        back = self._to_host()
        try:
            self._step()
        finally:
            self._to_device(back)
        return loss


def _to_cpu(value: Any) -> Any:
    """An optimizer state value on the host (a DTensor's local shard moved, its mesh and placements kept)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
        return value
    if isinstance(value, DTensor):  # its device is its local shard's
        return DTensor.from_local(value.to_local().cpu(), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return value.cpu()


def offload_optimizers(optimizers: list[Any], device: torch.device, offload: str) -> None:
    """offload=optimizer: each (torch) optimizer steps on the host (``HostStep``), once."""
    if offload != "optimizer":
        return
    for optimizer in optimizers:
        if not isinstance(getattr(optimizer.step, "__self__", None), HostStep):
            HostStep(optimizer, device)


def parameters_to_host(module: nn.Module) -> None:
    """offload=params on an accelerator: ``module``'s parameters moved to the CPU before ``fully_shard``, which
    requires them there (TP / EP have put theirs on the device); a parameter shared by several modules stays one
    tensor."""
    moved: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for key, p in sub._parameters.items():
            if p is None or p.device.type == "cpu":
                continue
            if id(p) not in moved:
                moved[id(p)] = nn.Parameter(p.detach().cpu(), requires_grad=p.requires_grad)
            sub._parameters[key] = moved[id(p)]


def check_offload(offload: str, precision: str, device_type: str) -> None:
    """Raise one ConfigError for offload=params with fp16-mixed on an accelerator: the loss scaler's found-inf
    check (``precision.ShardedGradScaler``) runs on the device, the offloaded gradients are on the host."""
    if offload == "params" and precision == "fp16-mixed" and device_type != "cpu":
        raise ConfigError("plan.offload", "offload=params keeps gradients on the host, where fp16-mixed's loss "
                          "scaler (on the device) cannot check them", "use bf16-mixed, or offload=optimizer")
