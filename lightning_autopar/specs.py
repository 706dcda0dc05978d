"""Typed specs shared by the CLI, Hydra, the planner and the strategy (the contract in ARCHITECTURE.md).

All are plain dataclasses usable as OmegaConf structured configs (``OmegaConf.structured(ModelSpec)``).
YAML presets live in ``configs/model`` and ``configs/cluster`` at the repository root.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from lightning_autopar.errors import ConfigError

# pipeline schedules (torch.distributed.pipelining): interleaved-zb = ScheduleInterleavedZeroBubble (vpp >= 2
# chunks per rank, round-robin), zbv = ScheduleZBVZeroBubble and dualpipev = ScheduleDualPipeV (exactly two
# chunks per rank in a V: rank r holds stages r and 2*pp-1-r; plan.vpp == 2)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
INTERLEAVED_SCHEDULES = ("interleaved", "interleaved-zb")  # vpp >= 2 chunks per rank, placed round-robin
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank, placed in a V
# recompute: none; selective (the attention core, Korthikanti et al. 2022); full (each block's forward again);
# ops (op-level selective checkpointing, torch.utils.checkpoint's policy: keep the outputs of matmuls, attention
# and the other compute-bound ops, recompute the rest; issue 17). plan.recompute_every = k applies the mode to
# one block in k (torchtitan's per-layer selective checkpointing), the others keep their activations.
RECOMPUTE_MODES = ("none", "selective", "full", "ops")
# offload (issue 17): none; optimizer (the optimizer states and their step on the host, ZeRO-Offload: the device
# keeps parameters and gradients); params (FSDP2's CPUOffloadPolicy: the sharded parameters, their gradients and
# the optimizer states on the host, each unit's parameters copied in for its forward and backward). Both need
# zero >= 1: what moves is this rank's shard.
OFFLOAD_MODES = ("none", "optimizer", "params")
# cp_kind (issue 29): how context-parallel attention meets the other ranks' tokens -- gather (K/V all-gathered
# along the sequence, Llama 3) or heads (q/k/v all-to-all from sequence parts to head parts, DeepSpeed-Ulysses;
# each rank's query heads, heads/tp, must divide by cp). Without cp it changes nothing.
CP_KINDS = ("gather", "heads")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "fp8-mixed")  # fp8-mixed: fp8 GEMMs, the rest bf16 (planner only)
FFN_KINDS = ("gelu", "swiglu")
# what a unit contains (UnitSpec.kinds); the cost model prices conv at the device's conv efficiency and norms /
# pooling as memory-bound work
UNIT_KINDS = ("conv", "linear", "batchnorm", "groupnorm", "layernorm", "norm", "pool", "attention", "mlp",
              "embedding", "tied")


def configs_dir() -> Path:
    """Where the YAML presets live: $AUTOPAR_CONFIGS, else ``configs/`` beside the package (source checkout)."""
    env = os.environ.get("AUTOPAR_CONFIGS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "configs"


# --------------------------------------------------------------------------------------------- model


@dataclass
class UnitSpec:
    """One unit of a model described by units (any ``nn.Module``: CNNs, U-Nets, encoders; ARCHITECTURE.md,
    contract additions). Units run one after another in the forward, partition the parameters, and are what
    FSDP shards, recompute checkpoints and pipeline stages split at. All sizes are per sample, for the forward,
    counted at 4-byte elements (the analysis traces fp32; the planner scales to the plan's precision):

    * ``flops``: forward FLOPs (backward priced as twice that); ``conv_flops``: the part in convolutions;
    * ``activation_bytes``: bytes saved for backward; ``output_bytes``: the unit's output (pipeline transfers);
    * ``memory_bytes``: bytes read and written by the memory-bound ops (norms, pooling, activations, adds);
    * ``ops``: eager ops in its forward (each pays the device's per-kernel overhead);
    * ``batchnorm_layers``: BatchNorm layers in the unit (each synchronises its statistics under data parallelism).
    """

    name: str = "unit"
    params: int = 0
    flops: float = 0.0
    conv_flops: float = 0.0
    activation_bytes: float = 0.0
    output_bytes: float = 0.0
    memory_bytes: float = 0.0
    ops: int = 0
    batchnorm_layers: int = 0
    kinds: list[str] = field(default_factory=list)
    frozen_params: int = 0  # of ``params``, those with requires_grad=False: no gradient, no optimizer state

    def validate(self, where: str = "model.units") -> None:
        for name in ("params", "flops", "conv_flops", "activation_bytes", "output_bytes", "memory_bytes", "ops",
                     "batchnorm_layers", "frozen_params"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{where}.{name}", f"must be a number >= 0, got {value!r}")
        if self.frozen_params > self.params:
            raise ConfigError(f"{where}.frozen_params", f"{self.frozen_params} exceeds params={self.params}")
        if self.conv_flops > self.flops:
            raise ConfigError(f"{where}.conv_flops", f"{self.conv_flops:g} exceeds flops={self.flops:g}",
                              "conv_flops is the part of flops spent in convolutions")
        for kind in self.kinds:
            if kind not in UNIT_KINDS:
                raise ConfigError(f"{where}.kinds", f"unknown {kind!r}", f"use any of {', '.join(UNIT_KINDS)}")


@dataclass
class ModelSpec:
    """A model as the planner sees it (contract field names): a decoder-only transformer by its fields, or --
    when ``units`` is given -- any model as a sequence of units (UnitSpec). In unit form the transformer fields
    are unused, ``layers`` is the number of units and a sample is one batch row (``seq_len`` 1)."""

    name: str = "model"
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    kv_heads: int | None = None  # default: heads (MHA); fewer for GQA/MQA
    ffn_hidden: int | None = None  # default: 4 * hidden
    ffn_kind: str = "gelu"  # gelu: 2 matrices, swiglu: 3
    vocab: int = 50257
    seq_len: int = 1024
    experts: int = 0  # 0 = dense
    top_k: int = 2
    moe_every: int = 1  # every k-th block is MoE when experts > 0
    tied_embeddings: bool = False
    # the MoE layers are written as a plain loop over their experts (no route()): under ep > 1 their forward runs
    # twice, capture and replay (parallel.experts.PlainExpertForward; priced by planner.cost.moe_replay_time)
    moe_replay: bool = False
    # the runtime can shard the token embedding and LM head by vocabulary over TP (parallel.vocab; False where the
    # model's capabilities refuse it: a weight used outside its module, not an nn.Embedding / nn.Linear). The
    # planner then divides them by tp where tp divides the vocabulary (planner.cost_memory.vocab_split)
    vocab_parallel: bool = True
    # the blocks drop out their hidden states (p > 0): the masks are kept for backward (Korthikanti et al. 2022's
    # count, planner.cost_memory.sp_replicated_elements); False where they do not (Llama; the analysis reads it
    # from the traced call, profile.trace.DropoutCalls)
    dropout: bool = True
    units: list[UnitSpec] = field(default_factory=list)  # unit form (any model); empty: a transformer
    # unit form from the module structure alone: why the meta trace of the forward failed. Only data
    # parallelism (DP, FSDP: no structure needed) is planned; the rest is excluded with this reason
    trace_failure: str = ""
    # parameters with requires_grad=False (a frozen vision tower): weights only, no gradient, no optimizer state,
    # no gradient reduction. Unit form: the units' sum (UnitSpec.frozen_params, which the planner reads per stage)
    frozen_params: int = 0

    def __post_init__(self) -> None:
        if self.units:
            self.units = [UnitSpec(**u) if isinstance(u, Mapping) else u for u in self.units]
            self.layers, self.seq_len, self.experts = len(self.units), 1, 0
            self.frozen_params = sum(u.frozen_params for u in self.units)
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden
        self.validate()

    @property
    def unit_form(self) -> bool:
        """Described by units (any model) rather than by transformer fields."""
        return bool(self.units)

    def validate(self) -> None:
        if self.units:
            names = set()
            for i, unit in enumerate(self.units):
                unit.validate(f"model.units[{i}]")
                if unit.name in names:
                    raise ConfigError(f"model.units[{i}].name", f"{unit.name!r} appears twice", "name each unit once")
                names.add(unit.name)
            if not sum(u.flops for u in self.units) > 0:
                raise ConfigError("model.units", "no unit has forward FLOPs", "give each unit its flops per sample")
            return
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name}", f"must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ConfigError("model.hidden", f"{self.hidden} is not divisible by heads={self.heads}",
                              "choose hidden as a multiple of heads")
        if self.heads % self.kv_heads:
            raise ConfigError("model.kv_heads", f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}",
                              "kv_heads must divide heads")
        if self.ffn_kind not in FFN_KINDS:
            raise ConfigError("model.ffn_kind", f"unknown {self.ffn_kind!r}", f"use one of {', '.join(FFN_KINDS)}")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise ConfigError("model.top_k", f"top_k={self.top_k} with experts={self.experts}",
                              "use 1 <= top_k <= experts (experts=0 means dense)")
        if self.moe_every < 1:
            raise ConfigError("model.moe_every", f"must be >= 1, got {self.moe_every}")
        if isinstance(self.frozen_params, bool) or not isinstance(self.frozen_params, int) or self.frozen_params < 0:
            raise ConfigError("model.frozen_params", f"must be an integer >= 0, got {self.frozen_params!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def moe_layers(self) -> int:
        """Number of MoE blocks (every ``moe_every``-th block, counting from the last of each group)."""
        return self.layers // self.moe_every if self.experts else 0

    @property
    def ffn_matrices(self) -> int:
        return 3 if self.ffn_kind == "swiglu" else 2

    def attention_params(self) -> int:
        """q, o: h x h; k, v: h x (kv_heads * head_dim) each (biases ignored)."""
        kv = self.kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv

    def mlp_params(self) -> int:
        return self.ffn_matrices * self.hidden * self.ffn_hidden

    def block_params(self, moe: bool = False) -> int:
        """Params of one block: attention + MLP (x experts, + router when MoE) + two norms."""
        mlp = self.mlp_params() * (self.experts if moe else 1) + (self.hidden * self.experts if moe else 0)
        return self.attention_params() + mlp + 4 * self.hidden

    def embedding_params(self) -> int:
        """Token embedding, plus the LM head unless tied, plus the final norm."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + 2 * self.hidden

    def total_params(self) -> int:
        if self.units:
            return int(sum(u.params for u in self.units))
        dense = self.layers - self.moe_layers
        return dense * self.block_params() + self.moe_layers * self.block_params(moe=True) + self.embedding_params()

    def trainable_share(self) -> float:
        """The share of the parameters that train (1 - frozen_params / total)."""
        return 1.0 - min(1.0, self.frozen_params / max(self.total_params(), 1))

    def active_params(self) -> int:
        """Parameters touched per token (MoE: top_k experts instead of all)."""
        if self.units:
            return self.total_params()
        moe_active = self.attention_params() + self.mlp_params() * self.top_k + 4 * self.hidden
        dense = self.layers - self.moe_layers
        return dense * self.block_params() + self.moe_layers * moe_active + self.embedding_params()


# --------------------------------------------------------------------------------------------- cluster


@dataclass
class PeakTflops:
    bf16: float = 0.0
    fp16: float = 0.0
    fp32: float = 0.0
    fp8: float = 0.0  # dense fp8 tensor-core rate (Transformer Engine GEMMs); 0: the device has none


@dataclass
class DeviceSpec:
    name: str = "cpu"
    memory_gib: float = 16.0
    peak_tflops: PeakTflops = field(default_factory=PeakTflops)
    memory_bandwidth_gbs: float = 20.0
    # Efficiency inputs of the planner's cost model (optional; defaults suit a datacenter GPU).
    gemm_efficiency: float = 0.8  # fraction of peak a large, well-shaped matmul sustains (measure.py)
    memory_efficiency: float = 0.85  # fraction of memory_bandwidth_gbs a streaming kernel sustains
    compute_units: int = 0  # SMs / AI cores / CPU cores, for wave quantisation (0 = ignore)
    tile: int = 128  # matmul output tile edge, for tile quantisation (1 = ignore)
    kernel_overhead_us: float = 4.0  # fixed cost per kernel / eager op (launch, dispatch, tail)
    reserved_gib: float = 0.0  # memory not available to tensors (runtime context, workspaces)
    comm_overlap: float = 1.0  # share of compute time that can hide communication (0: the same cores do both)
    # Added with defaults that keep the older behaviour (0 = derive / ignore):
    attention_efficiency: float = 0.0  # fused attention forward vs peak at head_dim 128, long sequence (0: derived)
    attention_bwd_efficiency: float = 0.0  # its backward kernel vs peak (0: as the forward)
    comm_sm_fraction: float = 0.0  # compute share the collective kernels take while overlapped (NCCL channels / SMs)
    dispatch_us: float = 0.0  # host time per eager op; the device waits when its kernels are shorter (0: ignore)
    conv_efficiency: float = 0.0  # fraction of peak a well-shaped convolution sustains (0: derived from gemm_efficiency)
    throughput_cv: float = 0.0  # device-to-device spread (std/mean) of sustained compute rate; steps run at the slowest
    # the training stack fuses each block's element-wise ops (Transformer Engine + Megatron fusions: norm with its
    # fp8 output cast, RoPE, gated activation, bias-dropout-add; planner.cost.block_memory_ops); False: eager
    # PyTorch ops, as autopar's runtime runs HF Llama and models.GPT
    fused_elementwise: bool = False
    # torch.compile (inductor) fuses each block's element-wise ops into generated kernels on this device and the
    # planner prices compile=true by that (Triton on CUDA GPUs: set on the GPU presets); False: compile=true is
    # priced as eager unless a measured speed-up is carried (RuntimeCosts.compile_speedup)
    compile_fuses: bool = False
    # the host behind each device, for offload (issue 17; 0 = no separate host memory: the device's memory *is*
    # host memory, as on a CPU, so offload saves nothing and the planner does not search it)
    host_link_gbs: float = 0.0  # device <-> host copy bandwidth per device, one direction (PCIe), GB/s
    host_memory_gib: float = 0.0  # host memory per device that offloaded states may take, GiB
    host_memory_bandwidth_gbs: float = 0.0  # host DRAM bandwidth per device share (the host optimizer step), GB/s


@dataclass
class LinkSpec:
    """One topology level, from the inside out. ``bandwidth_gbs``: GB/s per device, one direction."""

    level: str = "node"
    bandwidth_gbs: float = 1.0
    latency_us: float = 10.0
    topology: str = "switch"  # switch: any group gets full bandwidth; mesh: a group of g uses g-1 of the links
    efficiency: float = 1.0  # payload fraction of bandwidth_gbs a collective achieves (1.0 when probed)
    # a reduce-scatter's time over an all-gather's of the same bytes: 1 where both run the same ring (NCCL, HCCL);
    # measured at set-up elsewhere (gloo's reduce-scatter is slower than its all-gather)
    reduce_scatter_factor: float = 1.0


@dataclass
class RuntimeCosts:
    """Fixed host-side costs of autopar's runtime paths, in microseconds per occurrence: what a step costs beyond
    the device work and the collectives the other fields price. Measured on the live process group by
    ``profile/runtime.py`` and refit from measured steps (trials, StepMonitor) by ``planner/calibrate.py``;
    0 means not measured and adds nothing (the GPU presets)."""

    step_us: float = 0.0  # per optimizer step: the loop around it (hooks, closure, zero_grad, optimizer dispatch)
    microbatch_us: float = 0.0  # per micro-batch per rank: batch slicing, autocast / no_sync contexts, loss scaling
    # per FSDP unit per all-gather or reduce-scatter: pre/post hooks, copy-in/out dispatch (0 on a CPU device: its
    # eager ops counted at the device's per-op cost, planner.cost_runtime.fsdp_unit_seconds)
    fsdp_unit_us: float = 0.0
    tp_block_us: float = 0.0  # per block per micro-batch with tp > 1: DTensor dispatch and sharding propagation
    pipeline_action_us: float = 0.0  # per pipeline schedule action: one stage's fwd or bwd of one micro-batch + p2p posts
    ep_layer_us: float = 0.0  # per MoE layer per micro-batch with ep > 1: exchange splits and bookkeeping
    # per blocking collective call on the step's path: the wait for the group's last member beyond the
    # collective's own latency (ranks drift apart between calls; large when processes time-share cores)
    sync_us: float = 0.0
    source: str = ""  # where the figures come from ("profile 2026-12-01", "refit on 3 trials", ...)
    # a block's eager fwd+bwd time over its torch.compile'd time at the plan's micro-batch shape, measured at
    # set-up (profile/runtime.py phase_compile); 0: not measured (planner.cost.compiled_block_time)
    compile_speedup: float = 0.0

    def figures(self) -> dict[str, float]:
        """The costs by field name, microseconds (the ``_us`` fields)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith("_us")}

    def validate(self, where: str = "cluster.runtime") -> None:
        for name, value in self.figures().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"{where}.{name}", f"must be a number >= 0 (microseconds), got {value!r}")
        speedup = self.compile_speedup
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or speedup < 0:
            raise ConfigError(f"{where}.compile_speedup", f"must be a ratio >= 0 (0: not measured), got {speedup!r}")


@dataclass
class ClusterSpec:
    name: str = "cluster"
    nodes: int = 1
    devices_per_node: int = 1
    device: DeviceSpec = field(default_factory=DeviceSpec)
    links: list[LinkSpec] = field(default_factory=lambda: [LinkSpec()])
    runtime: RuntimeCosts = field(default_factory=RuntimeCosts)  # measured runtime fixed costs (0: none)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"cluster.{name}", f"must be a positive integer, got {value!r}")
        if self.device.memory_gib <= 0:
            raise ConfigError("cluster.device.memory_gib", f"must be > 0, got {self.device.memory_gib}")
        if not self.links:
            raise ConfigError("cluster.links", "needs at least one level", "add {level: node, bandwidth_gbs: ...}")
        for i, link in enumerate(self.links):
            if link.bandwidth_gbs <= 0 or link.latency_us < 0:
                raise ConfigError(f"cluster.links[{i}]", f"bandwidth {link.bandwidth_gbs} GB/s, "
                                  f"latency {link.latency_us} us", "bandwidth must be > 0 and latency >= 0")
        if isinstance(self.runtime, Mapping):
            self.runtime = RuntimeCosts(**self.runtime)
        self.runtime.validate()

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def link_for_span(self, group_span_devices: int, contiguous: bool = True) -> LinkSpec:
        """The link level a group of ``group_span_devices`` consecutive ranks crosses (inner first)."""
        if self.nodes == 1 or (contiguous and group_span_devices <= self.devices_per_node):
            return self.links[0]
        return self.links[-1]


# --------------------------------------------------------------------------------------------- measurements


@dataclass
class BlockMeasure:
    """Measured time and activation memory of one block kind at one (mbs, seq_len, precision), tp=1."""

    fwd_s: float
    bwd_s: float
    activation_bytes: float = 0.0


@dataclass
class Measured:
    """What profile/measure.py found on the live device; the planner scales it to each plan by the analytic ratio.
    A spec like the others: profile/ writes it, planner/ reads it, neither imports the other."""

    mbs: int
    seq_len: int
    precision: str
    blocks: dict[str, BlockMeasure] = field(default_factory=dict)  # "dense", "moe", "embedding", "head"
    device: str = ""

    @staticmethod
    def coerce(value: Any) -> "Measured | None":
        if value is None or isinstance(value, Measured):
            return value
        if isinstance(value, Mapping):
            blocks = {k: v if isinstance(v, BlockMeasure) else BlockMeasure(**v) for k, v in value.get("blocks", {}).items()}
            return Measured(int(value["mbs"]), int(value["seq_len"]), str(value["precision"]), blocks,
                            str(value.get("device", "")))
        raise TypeError(f"measured= expects a Measured or a mapping, got {type(value).__name__}")


@dataclass
class BlockSample:
    """One block kind timed on every rank at once (the slowest rank's figure) at one micro-batch size, tp=1:
    what the compute calibration (planner/calibrate.py) fits the device's rates to."""

    kind: str  # dense | moe | embedding | head (transformer form); a unit's name (unit form)
    mbs: int
    seq_len: int
    precision: str
    fwd_s: float
    bwd_s: float


@dataclass
class CollectiveSample:
    """One collective timed on the live process group (the slowest rank's median), nccl-tests conventions."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    ranks: int  # group size (2 for p2p)
    stride: int  # rank distance between consecutive members (1: neighbours)
    nbytes: int  # the full buffer; p2p: the message
    seconds: float  # p2p: one way


@dataclass
class TrialResult:
    """One plan run for a few steps at set-up (``AutoParallelStrategy(trials=K)``)."""

    plan: dict[str, Any]  # Plan.to_dict()
    predicted_s: float  # the prediction it was chosen on
    measured_s: float  # median step after warm-up
    steps: int = 0
    error: str = ""  # why it did not run (one line), empty when it ran


@dataclass
class RuntimeProfile:
    """What ``profile/runtime.py`` measured on the live process group at set-up, cached on disk by
    (cluster fingerprint, model fingerprint); ``planner/calibrate.py`` turns it into a calibrated ClusterSpec."""

    cluster_key: str = ""
    model_key: str = ""
    blocks: list[BlockSample] = field(default_factory=list)
    collectives: list[CollectiveSample] = field(default_factory=list)
    runtime: RuntimeCosts = field(default_factory=RuntimeCosts)  # fixed costs measured directly; 0: not measured
    trials: list[TrialResult] = field(default_factory=list)
    seconds: float = 0.0  # wall time spent measuring
    budget_s: float = 0.0  # the budget it ran under
    skipped: list[str] = field(default_factory=list)  # what the budget left out, one phrase each

    def __post_init__(self) -> None:
        self.blocks = [BlockSample(**b) if isinstance(b, Mapping) else b for b in self.blocks]
        self.collectives = [CollectiveSample(**c) if isinstance(c, Mapping) else c for c in self.collectives]
        self.trials = [TrialResult(**t) if isinstance(t, Mapping) else t for t in self.trials]
        if isinstance(self.runtime, Mapping):
            self.runtime = RuntimeCosts(**self.runtime)


# --------------------------------------------------------------------------------------------- plan

PLAN_INT_FIELDS = ("dp", "zero", "dp_shard", "tp", "pp", "vpp", "ep", "cp", "mbs", "grad_accum", "recompute_every")
PLAN_BOOL_FIELDS = ("sp", "compile")
PLAN_CHOICE_FIELDS = {"schedule": SCHEDULES, "recompute": RECOMPUTE_MODES, "precision": PRECISIONS,
                      "offload": OFFLOAD_MODES, "cp_kind": CP_KINDS}


@dataclass
class Plan:
    """One point of the hybrid space. Field names are fixed by the contract."""

    dp: int = 1
    zero: int = 0
    dp_shard: int | None = None  # hybrid sharding group size; None = all of dp
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    mbs: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    precision: str = "fp32"
    compile: bool = False  # torch.compile per block (contract additions 2026-12-01)
    recompute_every: int = 1  # the recompute mode on one block in k (1: every block); issue 17
    offload: str = "none"  # OFFLOAD_MODES: model states this rank shards kept on the host; issue 17
    cp_kind: str = "gather"  # CP_KINDS: K/V all-gathered, or all-to-all over heads (DeepSpeed-Ulysses); issue 29

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.mbs * self.grad_accum

    @property
    def shard_size(self) -> int:
        """Ranks over which model states are sharded (1 when zero == 0)."""
        return 1 if self.zero == 0 else (self.dp_shard or self.dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def short(self) -> str:
        """Compact one-line description, e.g. ``dp=2 zero=3 tp=2 mbs=4 ga=2``."""
        parts = [f"dp={self.dp}", f"zero={self.zero}"]
        if self.dp_shard and self.zero and self.dp_shard != self.dp:
            parts.append(f"shard={self.dp_shard}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + ("+sp" if self.sp else ""))
        if self.pp > 1:
            parts.append(f"pp={self.pp}/{self.schedule}" + (f"x{self.vpp}" if self.vpp > 1 else ""))
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}" + ("/heads" if self.cp_kind == "heads" else ""))
        parts.append(f"mbs={self.mbs} ga={self.grad_accum}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}" + (f"/{self.recompute_every}" if self.recompute_every > 1 else ""))
        if self.precision != "fp32":
            parts.append(self.precision)
        if self.compile:
            parts.append("compile")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return " ".join(parts)

    def validate(self, world_size: int | None = None, global_batch: int | None = None) -> None:
        """Check the contract identities; raise ConfigError naming the field and the fix."""
        for name in PLAN_INT_FIELDS:
            value = getattr(self, name)
            if name == "dp_shard" and value is None:
                continue
            low = 0 if name == "zero" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"plan.{name}", f"must be an integer >= {low}, got {value!r}")
        if self.zero > 3:
            raise ConfigError("plan.zero", f"must be 0, 1, 2 or 3, got {self.zero}")
        for name, choices in PLAN_CHOICE_FIELDS.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"plan.{name}", f"unknown {getattr(self, name)!r}", f"use one of {', '.join(choices)}")
        if self.dp_shard is not None and self.dp % self.dp_shard:
            raise ConfigError("plan.dp_shard", f"{self.dp_shard} does not divide dp={self.dp}",
                              "choose a divisor of dp")
        if self.sp and self.tp == 1:
            raise ConfigError("plan.sp", "sequence parallel needs tp > 1", "set tp >= 2 or sp=false")
        if self.recompute_every > 1 and self.recompute == "none":
            raise ConfigError("plan.recompute_every", f"recompute_every={self.recompute_every} with recompute=none "
                              "recomputes nothing", "set recompute=full or ops, or recompute_every=1")
        if self.offload != "none" and self.zero == 0:
            raise ConfigError("plan.offload", f"offload={self.offload} moves this rank's shard of the model states "
                              "to the host; zero=0 shards nothing", "set zero >= 1 or offload=none")
        if self.vpp > 1 and self.schedule not in INTERLEAVED_SCHEDULES + V_SCHEDULES:
            raise ConfigError("plan.vpp", f"vpp={self.vpp} needs an interleaved or V schedule",
                              "set schedule=interleaved, interleaved-zb, zbv or dualpipev")
        if self.schedule in V_SCHEDULES and self.pp > 1 and self.vpp != 2:
            raise ConfigError("plan.vpp", f"schedule={self.schedule} runs two stages per pipeline rank (a V), got "
                              f"vpp={self.vpp}", "set vpp=2")
        if world_size is not None and self.world_size != world_size:
            raise ConfigError("plan", f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.world_size} "
                              f"!= world size {world_size}", "choose degrees whose product is the world size")
        if global_batch is not None and self.global_batch != global_batch:
            raise ConfigError("plan.grad_accum", f"dp*mbs*grad_accum = {self.global_batch} != global batch "
                              f"{global_batch}", "choose mbs and grad_accum with dp*mbs*grad_accum == global batch")


@dataclass
class Breakdown:
    compute_s: float = 0.0
    recompute_s: float = 0.0
    comm_exposed_s: float = 0.0
    bubble_s: float = 0.0
    runtime_s: float = 0.0  # the runtime's fixed host costs (ClusterSpec.runtime), named in ``terms``
    terms: dict[str, float] = field(default_factory=dict)  # runtime_s by cost_runtime.py term name (seconds)


@dataclass
class PricedPlan:
    """A plan with the cost model's prediction (contract: the priced-plan fields)."""

    plan: Plan
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    model_tflops_per_device: float = 0.0
    mfu: float = 0.0
    memory_gib_per_device: float = 0.0
    breakdown: Breakdown = field(default_factory=Breakdown)
    feasible: bool = True
    reason: str = ""  # why infeasible (memory, divisibility), empty when feasible
    layers_per_stage: list[int] = field(default_factory=list)  # blocks per pipeline chunk (pp*vpp), if pp > 1
    # GiB per device by term (search._memory_terms): parameters, gradients, optimizer, activations, buffers,
    # reserved; sums to memory_gib_per_device (issue 17)
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    # GiB per device of model states kept in host memory (plan.offload; issue 17), not in memory_gib_per_device
    # where the device has host memory of its own (DeviceSpec.host_link_gbs > 0)
    host_gib_per_device: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = self.plan.to_dict()
        out.update(
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
            model_tflops_per_device=self.model_tflops_per_device,
            mfu=self.mfu,
            memory_gib_per_device=self.memory_gib_per_device,
            breakdown={k: getattr(self.breakdown, k) for k in ("compute_s", "recompute_s", "comm_exposed_s",
                                                              "bubble_s")},
            feasible=self.feasible,
        )
        if self.breakdown.terms:  # the runtime's fixed costs (ClusterSpec.runtime), beside the contract's four
            out["runtime_terms_s"] = dict(self.breakdown.terms)
        if self.reason:
            out["reason"] = self.reason
        if self.layers_per_stage:
            out["layers_per_stage"] = list(self.layers_per_stage)
        if self.memory_breakdown:
            out["memory_breakdown_gib"] = dict(self.memory_breakdown)
        if self.host_gib_per_device:
            out["host_gib_per_device"] = self.host_gib_per_device
        return out


# --------------------------------------------------------------------------------------------- fix parsing


def _coerce(name: str, raw: Any) -> Any:
    """Convert one ``fix`` value to the plan field's type, or raise ConfigError."""
    if name in PLAN_INT_FIELDS:
        if isinstance(raw, bool):
            raise ConfigError(f"fix.{name}", f"expected an integer, got {raw!r}")
        try:
            value = int(str(raw).strip())
        except ValueError:
            raise ConfigError(f"fix.{name}", f"expected an integer, got {raw!r}", f"e.g. {name}=2") from None
        low = 0 if name == "zero" else 1
        if value < low or (name == "zero" and value > 3):
            rng = "0..3" if name == "zero" else ">= 1"
            raise ConfigError(f"fix.{name}", f"{value} is out of range", f"use a value {rng}")
        return value
    if name in PLAN_BOOL_FIELDS:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"fix.{name}", f"expected true or false, got {raw!r}")
    choices = PLAN_CHOICE_FIELDS[name]
    text = str(raw).strip().lower()
    aliases = {"32": "fp32", "32-true": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed", "16-mixed": "fp16-mixed",
               "fp8": "fp8-mixed"}
    text = aliases.get(text, text) if name == "precision" else text
    if name == "cp_kind":
        text = {"ulysses": "heads", "all-to-all": "heads", "allgather": "gather", "all-gather": "gather"}.get(text, text)
    if text not in choices:
        raise ConfigError(f"fix.{name}", f"unknown {raw!r}", f"use one of {', '.join(choices)}")
    return text


PLAN_FIELDS = tuple(f.name for f in fields(Plan))


def parse_fix(fix: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Parse ``"tp=2,pp=2"`` or a dict into validated plan-field values. Unknown keys and bad values raise."""
    if fix is None:
        return {}
    if isinstance(fix, str):
        items: dict[str, Any] = {}
        for part in (p.strip() for p in fix.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise ConfigError("fix", f"{part!r} is not key=value", "write e.g. 'tp=2,pp=2'")
            key, value = part.split("=", 1)
            items[key.strip()] = value.strip()
    elif isinstance(fix, Mapping):
        items = dict(fix)
    else:
        raise ConfigError("fix", f"expected a 'k=v,...' string or a dict, got {type(fix).__name__}")
    out: dict[str, Any] = {}
    for key, value in items.items():
        if key not in PLAN_FIELDS:
            raise ConfigError(f"fix.{key}", "unknown plan field", f"use one of {', '.join(PLAN_FIELDS)}")
        if key == "dp_shard" and value in (None, "none", "None"):
            out[key] = None
            continue
        out[key] = _coerce(key, value)
    return out


# --------------------------------------------------------------------------------------------- YAML loading


def _from_mapping(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build a (nested) spec dataclass from a mapping: directly where every value already has its field's type
    (``_typed``, the presets), else through OmegaConf, whose conversions and errors (ConfigError) are the
    contract's."""
    obj = _typed(cls, data)
    if obj is not _UNTYPED:
        if hasattr(obj, "validate"):
            obj.validate()
        return obj
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        schema = OmegaConf.structured(cls)
        merged = OmegaConf.merge(schema, OmegaConf.create(dict(data)))
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        msg = str(err).splitlines()[0]
        raise ConfigError(f"{where}.{key}", msg, f"see the {cls.__name__} fields in lightning_autopar/specs.py") from None
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


_UNTYPED = object()  # _typed's answer where OmegaConf must build (a conversion, an unknown key, another type)


def _typed(tp: Any, value: Any) -> Any:
    """``value`` as type ``tp`` (a spec dataclass, int, float, bool, str, X | None, list[X]) where it already is one
    (an int for a float widened, as OmegaConf does), else _UNTYPED: importing OmegaConf and merging a structured
    config cost more than the planning of a small model, and a preset needs neither."""
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            return _UNTYPED
        hints = _hints(tp)
        kwargs = {}
        for key, item in value.items():
            if key not in hints:
                return _UNTYPED
            kwargs[key] = _typed(hints[key], item)
            if kwargs[key] is _UNTYPED:
                return _UNTYPED
        return tp(**kwargs)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args:
        return None if value is None else _typed(args[0] if args[1] is type(None) else args[1], value)
    if origin is list and isinstance(value, list):
        items = [_typed(args[0], item) for item in value]
        return _UNTYPED if any(item is _UNTYPED for item in items) else items
    if tp is float and type(value) in (int, float):
        return float(value)
    if tp in (int, bool, str) and type(value) is tp and not (tp is str and ("${" in value or value == "???")):
        return value  # (an interpolation or OmegaConf's missing-value marker is OmegaConf's to read)
    return _UNTYPED


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """The resolved field types of a spec dataclass (its annotations are strings: postponed evaluation)."""
    names = {f.name for f in fields(cls) if f.init}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def _read_yaml(path: Path, where: str) -> dict[str, Any]:
    try:
        text = path.read_text()
        if "${" in text:  # interpolations: only OmegaConf resolves them
            from omegaconf import OmegaConf

            data = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
        else:  # the common case: libyaml's parser, measurably faster than OmegaConf's pure-Python one per preset
            import yaml

            data = yaml.load(text, Loader=_yaml_loader())
    except Exception as err:  # a YAML syntax error is bad input, not a crash
        raise ConfigError(where, f"cannot read {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(where, f"{path} does not hold a mapping")
    data.pop("defaults", None)
    return data


_LOADER: list[type] = []  # built once: adding resolvers to a loader class is not free


def _yaml_loader() -> type:
    """A PyYAML loader that reads a spec file as OmegaConf.load does (the spec dataclasses then type every field):
    YAML 1.2 floats such as ``1e-3`` (PyYAML's YAML 1.1 reads them as strings), no timestamps, a duplicate key
    refused. On PyYAML's C parser (CSafeLoader) where libyaml is installed, else the pure-Python SafeLoader."""
    if _LOADER:
        return _LOADER[0]
    import re

    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class SpecLoader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            keys = [k.value for k, _ in node.value if k.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG]
            for i, key in enumerate(keys):
                if key in keys[:i]:
                    raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                            f"found duplicate key {key}", node.start_mark)
            return super().construct_mapping(node, deep=deep)

    SpecLoader.yaml_implicit_resolvers = {
        key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for key, resolvers in base.yaml_implicit_resolvers.items()}
    SpecLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
         [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
        |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
        |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
    _LOADER.append(SpecLoader)
    return SpecLoader


def _resolve(kind: str, name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(kind, f"file {name_or_path} not found")
        return path
    preset = configs_dir() / kind / f"{name_or_path}.yaml"
    if not preset.is_file():
        known = sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))
        raise ConfigError(kind, f"unknown preset {name_or_path!r}", f"use a YAML file or one of {', '.join(known)}")
    return preset


def load_model_spec(model: str | Mapping[str, Any] | ModelSpec) -> ModelSpec:
    """A ModelSpec from a preset name (configs/model), a YAML path, a mapping, or a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    data = model if isinstance(model, Mapping) else _read_yaml(_resolve("model", model), "model")
    return _from_mapping(ModelSpec, data, "model")


def load_cluster_spec(
    cluster: str | Mapping[str, Any] | ClusterSpec,
    nodes: int | None = None,
    devices_per_node: int | None = None,
) -> ClusterSpec:
    """A ClusterSpec from a preset name (configs/cluster), a YAML path, a mapping or a ClusterSpec; overrides."""
    if isinstance(cluster, ClusterSpec):
        spec = dataclasses.replace(cluster)
    else:
        data = cluster if isinstance(cluster, Mapping) else _read_yaml(_resolve("cluster", cluster), "cluster")
        spec = _from_mapping(ClusterSpec, data, "cluster")
    if nodes is not None:
        spec.nodes = nodes
    if devices_per_node is not None:
        spec.devices_per_node = devices_per_node
    spec.validate()
    return spec
