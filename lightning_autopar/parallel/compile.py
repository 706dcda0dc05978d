"""Per-block ``torch.compile`` (``plan.compile``), in the canonical order after TP/SP and EP, its check hook before
recompute's hooks, and before FSDP/DP (torchtitan's order: TP -> AC -> compile -> FSDP; the compiled forward does
not depend on the hooks' order).

Only each block's ``forward`` is compiled (an instance attribute shadowing the class's): the module, its
parameter names and every hook stay as they were, so our TP hooks, the recompute checkpoint and FSDP2/DDP run
eagerly around the compiled body (hooks of submodules inside the block are traced; the TP hooks' collectives
are graph breaks, hence ``fullgraph=False``).

Compilation is lazy, so a block that cannot compile would otherwise fail mid-step (the backward graph compiles at
the first backward). Each block class is checked once, at its first training call (grad enabled, training mode):
a forward pre-hook, which runs before the recompute checkpoint enters its context, runs the compiled forward and
backward on detached copies of the block's real inputs (``torch.autograd.grad``: no gradient is accumulated) and
on failure warns once naming the block and the error's first line; every block of that class then runs eager.
Calls before the check (the sanity validation under ``no_grad``) run eager. ``plan.compile`` stays true: it says
what was asked, the warning says which blocks run eager.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_autopar.errors import ConfigError


@dataclass
class CompileCheck:
    """The outcome for one block class: ``None`` until checked, then True (compiled) or False (eager)."""

    ok: bool | None = None
    reason: str = ""


@dataclass
class CompiledBlocks:
    """What ``compile_blocks`` did: the checks per block class and the names of the blocks of each class."""

    checks: dict[type, CompileCheck] = field(default_factory=dict)
    names: dict[type, list[str]] = field(default_factory=dict)

    def eager_blocks(self) -> list[str]:
        """Blocks that run eager because their class failed its check."""
        return [n for cls, check in self.checks.items() if check.ok is False for n in self.names[cls]]


def check_compile(compile: bool, pp: int, device_type: str, async_tp: bool = False, schedule: str = "1f1b") -> None:
    """Raise one ConfigError for a compile request the runtime cannot apply: with a zero-bubble pipeline schedule
    (``planner.space.compile_rule``: torch pipelining refuses compiled stages when it splits each stage's backward
    into input and weight gradients), and async TP off a CUDA device (symmetric memory and inductor's
    micro-pipelined TP pass exist only there)."""
    from lightning_autopar.planner.space import compile_rule

    why = compile_rule(schedule, pp, compile)
    if why is not None:
        raise ConfigError("plan.compile", why, "use compile=false, or a pipeline schedule without the split backward "
                          "(gpipe, 1f1b, interleaved)")
    if async_tp and device_type != "cuda":
        raise ConfigError("async_tp", f"async TP needs CUDA symmetric memory and inductor's micro-pipelined TP; "
                          f"this run is on {device_type}", "leave async TP off (it is a GPU-only feature)")


def enable_async_tp(tp_mesh: Any) -> None:
    """Async TP (CUDA only; torchtitan's ``enable_async_tensor_parallel``): inductor's micro-pipelined TP pass
    splits each all-gather -> matmul and matmul -> reduce-scatter it finds in a compiled graph into per-rank steps
    over symmetric memory of the TP group. Untested here (no GPU); whether our TP hooks' collectives reach an
    inductor graph (they are graph breaks on gloo) is for a GPU run to show."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def compile_blocks(blocks: Mapping[str, nn.Module], backend: str | Callable = "inductor") -> CompiledBlocks:
    """Compile each block's forward (module doc) with a first-call check per block class; returns the record
    the checks fill in (``CompiledBlocks.eager_blocks``)."""
    out = CompiledBlocks()
    for name, block in blocks.items():
        cls = type(block)
        check = out.checks.setdefault(cls, CompileCheck())
        out.names.setdefault(cls, []).append(name)
        _compile_one(name, block, check, backend)
    return out


def _compile_one(name: str, block: nn.Module, check: CompileCheck, backend: str | Callable) -> None:
    eager = block.forward
    compiled = torch.compile(eager, backend=backend, fullgraph=False)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return (compiled if check.ok else eager)(*args, **kwargs)

    def first_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if check.ok is None and module.training and torch.is_grad_enabled():
            check.ok, check.reason = _trial(compiled, args, kwargs, list(module.parameters()))
            if not check.ok:
                warnings.warn(f"plan.compile: block '{name}' ({type(module).__name__}) failed to compile "
                              f"({check.reason}); every {type(module).__name__} block runs eager, the other "
                              "blocks stay compiled", stacklevel=2)
        return None

    block.forward = forward  # instance attribute: shadows the class's forward, names and hooks unchanged
    # after the hooks registered before (SP's scatter: the trial sees the inputs the forward gets), before the
    # recompute checkpoint's pre-hook (applied after compile) enters its saved-tensor context; FSDP2, applied
    # later with prepend, still runs first: parameters are unsharded here
    block.register_forward_pre_hook(first_call, with_kwargs=True)


def _trial(fn: Callable, args: tuple, kwargs: dict, params: Iterable[torch.Tensor]) -> tuple[bool, str]:
    """(True, "") when ``fn`` runs forward and backward on detached copies of the inputs, else (False, the
    error's first line). Gradients go to ``torch.autograd.grad``'s result, never to ``.grad``."""
    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            y = x.detach().clone()
            return y.requires_grad_(y.is_floating_point() and x.requires_grad)
        return x

    args, kwargs = tree_map(copy, (args, kwargs))
    try:
        out = tree_flatten(fn(*args, **kwargs))[0]
        outs = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt += [p for p in params if p.requires_grad]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
    except Exception as err:  # noqa: BLE001 -- any compile failure means: run eager
        return False, _first_line(err)
    return True, ""


def _first_line(err: BaseException) -> str:
    """The root cause's type and first line, with dynamo's one-line explanation when it gives one (its
    errors name the failure first and what it met in an ``Explanation:`` line)."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = [line.strip() for line in str(err).strip().splitlines()]
    why = next((line for line in lines if line.startswith("Explanation:")), "")
    return f"{type(err).__name__}: {lines[0] if lines else ''}" + (f" ({why})" if why else "")
