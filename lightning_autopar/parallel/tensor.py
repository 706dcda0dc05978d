"""Tensor parallelism (Megatron layouts through DTensor ``parallelize_module``), derived from the analysis.

Per block: q, k, v (or the MLP's up and gate) are ``ColwiseParallel`` (each rank owns whole heads / a slice of
the FFN), o and down are ``RowwiseParallel`` (partial sums all-reduced), so each block costs two all-reduces
forward and two backward. MoE experts are split the same way inside each expert; the router stays replicated.
Experts stored as fused 3-D weights (HF Mixtral's ``gate_up_proj`` fuses gate and up along dim 1) are not split:
``check_tp`` rejects tp > 1 for them and the strategy plans tp=1 (EP and FSDP shard them instead).
Embeddings, norms and the LM head stay replicated across the TP group. Head-count attributes found by the
analysis (e.g. ``n_heads``) are divided by ``tp`` so the module's own reshapes see the local width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lightning_autopar.errors import ConfigError
from lightning_autopar.profile.analyze import BlockInfo, MLPInfo, ModelAnalysis

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def check_tp(analysis: ModelAnalysis, tp: int, structure_only: bool = False) -> None:
    """Raise one clear ConfigError when ``tp`` cannot shard this model. ``structure_only``: check only what the
    model's structure allows (the planner's divisibility rules handle head and FFN counts)."""
    if tp == 1:
        return
    spec = analysis.spec
    for block in analysis.blocks:
        attn = block.attention
        if attn is None or attn.o is None or not (attn.q or attn.qkv):
            raise ConfigError("plan.tp", f"{block.fqn}: attention projections not recognised, so tp={tp} cannot "
                              "split it", "use tp=1, or separate q/k/v/o nn.Linear layers")
        if attn.fused:
            raise ConfigError("plan.tp", f"{block.fqn}.{attn.fqn}.{attn.qkv} is a fused qkv projection; a column "
                              "split would mix q, k and v", "use tp=1, or separate q/k/v projections")
        if block.mlp is None and block.moe is None:
            raise ConfigError("plan.tp", f"{block.fqn}: MLP not recognised", "use tp=1")
        if block.moe is not None and block.moe.fused:
            raise ConfigError("plan.tp", f"{block.fqn}.{block.moe.fqn}: experts stored as fused 3-D weights "
                              f"({', '.join(block.moe.fused_params)}) are not split by TP",
                              "use tp=1 (ep and dp shard these experts)")
    if structure_only:
        return
    if spec.heads % tp or spec.kv_heads % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide heads={spec.heads} and kv_heads={spec.kv_heads}",
                          f"choose tp among the common divisors of {spec.heads} and {spec.kv_heads}")
    if spec.ffn_hidden % tp:
        raise ConfigError("plan.tp", f"tp={tp} does not divide ffn_hidden={spec.ffn_hidden}", "choose a divisor")


def _mlp_layout(prefix: str, mlp: MLPInfo) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    join = (lambda n: f"{prefix}.{n}" if prefix else n)
    layout = {join(mlp.up): ColwiseParallel(), join(mlp.down): RowwiseParallel()}
    if mlp.gate:
        layout[join(mlp.gate)] = ColwiseParallel()
    return layout


def block_layout(block: BlockInfo, num_experts_local: int | None = None) -> dict:
    """FQN (relative to the block) -> ParallelStyle for one block."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    attn = block.attention
    assert attn is not None
    layout: dict = {f"{attn.fqn}.{name}": ColwiseParallel() for name in (attn.q, attn.k, attn.v)}
    layout[f"{attn.fqn}.{attn.o}"] = RowwiseParallel()
    if block.mlp is not None:
        layout.update(_mlp_layout(block.mlp.fqn, block.mlp))
    if block.moe is not None and block.moe.expert_mlp is not None:
        base = f"{block.moe.fqn}.{block.moe.experts}" if block.moe.fqn else block.moe.experts
        count = block.moe.num_experts if num_experts_local is None else num_experts_local
        for e in range(count):
            layout.update(_mlp_layout(f"{base}.{e}", block.moe.expert_mlp))
    return layout


def apply_tensor_parallel(transformer: nn.Module, analysis: ModelAnalysis, tp_mesh: DeviceMesh) -> None:
    """Shard every block of ``transformer`` over ``tp_mesh`` in place; parameter names are unchanged."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    check_tp(analysis, tp)
    if tp == 1:
        return
    for info in analysis.blocks:
        block = transformer.get_submodule(info.fqn)
        moe_list = None
        if info.moe is not None:
            moe_mod = block.get_submodule(info.moe.fqn) if info.moe.fqn else block
            moe_list = len(moe_mod.get_submodule(info.moe.experts))  # EP may have removed remote experts
        parallelize_module(block, tp_mesh, block_layout(info, moe_list))
        attn = block.get_submodule(info.attention.fqn)
        for attr in info.attention.heads_attrs:
            setattr(attn, attr, getattr(attn, attr) // tp)
        for attr in info.attention.kv_heads_attrs:
            setattr(attn, attr, getattr(attn, attr) // tp)
