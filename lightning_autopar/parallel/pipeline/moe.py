"""MoE values across stages: the load-balancing losses of every stage's MoE layers reach the user's loss on the
last stage, exactly as on one device (their gradients then flow back through the schedule).

Each non-last chunk sends, next to its activation, one tensor per MoE layer so far (``MoESource``): the layer's
``aux_loss`` attribute (``models.gpt.MoE``; any MoE module keeping its balance loss in a tensor attribute of that
name), or the router output Hugging Face records for its balance loss (``_can_record_outputs["router_logits"]``,
e.g. Mixtral's router logits). On the last chunk the received values are handed to the user's code where it
looks for them: attributes are set on parameter-free stand-ins of the layers' modules (same class, registered
beside the blocks as ``pipeline_moe_stand_ins``, so ``isinstance`` walks over ``modules()`` find them; on the
layer's own module when this rank holds it), and recorded router outputs are replayed by stand-in routers
before the chunk's first block, so Hugging Face's recorder lists every layer in order. A balance loss kept
anywhere else (e.g. returned through the block outputs) is not carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.pipeline.standins import stand_in_module

if TYPE_CHECKING:
    from lightning_autopar.profile.analyze import ModelAnalysis


@dataclass
class MoESource:
    """A per-layer value the user's loss reads on the last stage but the layer's own stage computes: an MoE
    module's load-balancing loss attribute (``attr``, as ``models.gpt.MoE.aux_loss``), or a router output that
    Hugging Face records for its balance loss (``index`` into the router's output tuple)."""

    block: str  # the block's key in the blocks container
    module: nn.Module
    attr: str | None = None
    index: int | None = None


def router_recorder(root: nn.Module) -> tuple[type, int] | None:
    """(router class, output index) when a Hugging Face model in ``root`` records router outputs for its
    load-balancing loss (``_can_record_outputs["router_logits"]``), else None."""
    for module in root.modules():
        spec = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        for one in spec if isinstance(spec, list) else [spec] if spec is not None else []:
            if isinstance(one, type):
                return one, 1  # a bare class records output[1] (transformers' convention)
            if getattr(one, "target_class", None) is not None:
                return one.target_class, int(one.index)
            raise ConfigError("plan.pp", f"{type(module).__name__} records its router outputs by module name "
                              f"({one.class_name!r}), which pipeline stages cannot carry to the last stage",
                              "use pp=1")
    return None


def moe_sources(root: nn.Module, analysis: ModelAnalysis, items: Sequence[tuple[str, nn.Module]]) -> list[MoESource]:
    """The MoE values of the blocks ``items`` (in block order) that the last stage's loss may read."""
    recorder = router_recorder(root)
    moe_of = {info.fqn.rsplit(".", 1)[-1]: info.moe for info in analysis.blocks if info.moe is not None}
    sources = []
    for key, block in items:
        info = moe_of.get(key)
        if info is not None:
            module = block.get_submodule(info.fqn) if info.fqn else block
            if isinstance(getattr(module, "aux_loss", None), torch.Tensor):
                sources.append(MoESource(key, module, attr="aux_loss"))
        if recorder is not None:
            sources += [MoESource(key, m, index=recorder[1]) for m in block.modules() if isinstance(m, recorder[0])]
    return sources


def install_recorders(root: nn.Module) -> None:
    """Install Hugging Face's output-recorder hooks on the whole model now: transformers installs them lazily on
    the first forward that records, which after the split would only see one chunk's modules."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # another transformers layout: its hooks, if any, are its own business
        return
    recording = [m for m in root.modules() if getattr(type(m), "_can_record_outputs", None)]
    for module in recording:
        # the innermost recording model only (the one whose forward records): installing from a wrapper would
        # install its inner model's hooks a second time when they are already there
        if not any(other is not module and other in set(module.modules()) for other in recording):
            maybe_install_capturing_hooks(module)


class _ReplayForward:
    """A stand-in router's forward on the last stage: returns the received value where Hugging Face's output
    recorder reads it, so the model's own balance loss sees every layer in order."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.value: torch.Tensor | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        return tuple(self.value if i == self.index else None for i in range(self.index + 1))


def hand_over_targets(before: list[MoESource], local_keys: set[str], transformer: nn.Module,
                      blocks_fqn: str) -> list[nn.Module]:
    """Last chunk: per earlier MoE value, the module the user's loss reads it from. An attribute goes on the
    layer's own module when this rank holds it (interleaved schedules), else on a stand-in; a recorded router
    output is always replayed by a stand-in router. Stand-ins are registered beside the blocks (no parameters,
    so names and state dicts are unchanged) where the user's ``modules()`` walk and Hugging Face's recorder
    find them."""
    targets: list[nn.Module] = []
    stand_ins = []
    for source in before:
        if source.attr is not None and source.block in local_keys:
            targets.append(source.module)
            continue
        ghost = stand_in_module(source.module)
        if source.attr is not None:
            setattr(ghost, source.attr, torch.zeros(()))
        else:
            ghost.forward = _ReplayForward(source.index)
        targets.append(ghost)
        stand_ins.append(ghost)
    if stand_ins:
        parent, _, _ = blocks_fqn.rpartition(".")
        owner = transformer.get_submodule(parent) if parent else transformer
        owner.add_module("pipeline_moe_stand_ins", nn.ModuleList(stand_ins))
    return targets
