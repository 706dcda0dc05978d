"""Published large-scale training runs priced by the planner: predicted vs published step time per row.

    python benchmarks/published_runs.py [--csv PATH] [--markdown]

Each row of ``/work/shared/reference/published_runs_dev.csv`` (torchtitan on H100 and A100, the Llama 3 paper,
NeMo, Megatron-Bridge) states its parallel layout; the row is priced with exactly that layout by
``planner.search.estimate`` on the row's device and node count, never searched, never fitted:

* dp = the row's dp; zero=3 when fsdp=1 (torchtitan FSDP2, Megatron FSDP), else zero=1 (Megatron's distributed
  optimizer); tp with sequence parallelism when tp > 1 (both stacks run it so); pp, cp as stated; the
  interleaved schedule when the row says so or vpp > 1; recompute as stated (blank: none); precision bf16-mixed,
  or fp8-mixed for the fp8 rows (fp8 GEMMs, attention and the rest in bf16: Transformer Engine).
* rows without mbs: the note's local batch (sequences per dp rank) split over the pipeline's micro-batches.
  torchtitan's Interleaved 1F1B (2024-12) runs n_microbatches = pp by default and, with no split points given,
  two stages per rank (vpp 2): mbs = local / pp. The Llama 3 paper runs micro-batch 1 (its Fig. 6 schedule is
  per sequence) and states no vpp; vpp 2 is assumed (the smallest interleaving), and said so in the table.
* published step = global_batch * seq / (tokens_per_s_per_gpu * gpus). The Llama 3 paper publishes TFLOP/s per
  GPU instead: step = global_batch * seq * F / (TFLOP/s * gpus), with F = planner.cost.model_flops_per_token
  (3 x forward: 6N + 12*L*h*s attention, the LM head included; Meta's MFU = that rate / 989: 430/989 = 43%).
* compile=1 rows (torch.compile per block): not a plan field yet (issue 15); priced with the element-wise ops
  fused (DeviceSpec.fused_elementwise: Inductor emits the RMSNorm as one reduction kernel and fuses the SwiGLU and
  RoPE pointwise chains), everything else as compile=0, and reported apart: their errors are not in the median/max
  the targets read.
* the stack's kernels: torchtitan and the Llama 3 paper as eager PyTorch (SDPA flash attention, the fp32 RMSNorm
  op by op: cost.norm_traffic); NeMo / Megatron-Bridge as Transformer Engine (TE_ATTENTION, TE_FUSIONS) with their
  tensor-parallel communication overlapped with the GEMMs (tp_overlap_hidden).
* 405B with pp*vpp not dividing its 126 layers: Megatron and Meta count the embedding and the loss as one layer
  each (126 + 2 = 128 = pp*vpp*2), which planner.space.check_fix does not accept; those rows are priced through
  the same calls estimate() makes after that check (space_from_plans, price, priced_plan).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_autopar.planner import cost as C  # noqa: E402
from lightning_autopar.planner import search as S  # noqa: E402
from lightning_autopar.planner.space import space_from_plans  # noqa: E402
from lightning_autopar.specs import (ClusterSpec, ModelSpec, Plan, PricedPlan, load_cluster_spec,  # noqa: E402
                                     load_model_spec)

CSV_PATH = Path("/work/shared/reference/published_runs_dev.csv")
DEVICES = {"h100-96g-500w": "h100-96g-500w", "h100-sxm": "h100-sxm-dgx", "a100-80g": "a100-80g-dgx"}
# model name in the CSV -> preset (configs/model) and the fields that differ from it (the CSV header's shapes)
MODELS = {
    "llama3-8b": ("llama3-8b", {}), "llama3.1-8b": ("llama3-8b", {}),
    "llama3-70b": ("llama3-70b", {}), "llama3.1-70b": ("llama3-70b", {}),
    "llama3.1-405b": ("llama3-405b", {}),
    "llama2-7b": ("llama2-7b", {}), "llama2-13b": ("llama2-13b", {}), "llama2-70b": ("llama2-70b", {}),
    # Megatron/NeMo pad GPT-3's 50257 tokens to 51200 and keep an untied output layer
    "gpt3-175b": ("gpt3-175b", {"vocab": 51200, "tied_embeddings": False}),
}
# The attention kernel is the stack's: torchtitan and Meta run PyTorch SDPA's flash backend (FlashAttention-2, the
# presets' figures); NeMo and Megatron-Bridge run Transformer Engine's cuDNN fused attention, a Hopper-native
# (TMA/WGMMA) kernel like FlashAttention-3: bf16, head_dim 128, causal, 8k tokens ~610 TFLOP/s forward and ~470
# backward of 989 on an H100 SXM (Shah et al. 2024, FlashAttention-3, figs. 5-6, the FA3 and cuDNN curves).
TE_ATTENTION = {"attention_efficiency": 0.61, "attention_bwd_efficiency": 0.47}
# The same stacks run the block's element-wise ops as fused kernels (NeMo 24.07 / Megatron-Bridge llama and gpt3
# recipes: Transformer Engine LayerNormLinear / LayerNormMLP with the norm's fp8 output cast, apply_rope_fusion,
# bias_activation_fusion (swiglu), bias_dropout_add_fusion, TE fused attention in the [s, b, h] layout):
# DeviceSpec.fused_elementwise (planner.cost.block_memory_ops / norm_traffic / fp8_cast_time).
TE_FUSIONS = {"fused_elementwise": True}
# ...and, with tp > 1, overlap the tensor-parallel all-gathers / reduce-scatters with the GEMMs that consume or
# produce them (tp_comm_overlap / ub_tp_comm_overlap with userbuffers in the NeMo 24.07 llama2-70b, llama3-70b and
# gpt3-175b and the Megatron-Bridge 25.11 llama3 70b / 405b performance configs): priced by tp_overlap_hidden.
TE_STACKS = ("NeMo", "Megatron")
DEVICES_PER_HOST = 8
UNSTATED_VPP = 2  # interleaved rows that state no vpp: the smallest interleaving (see the module docstring)
TARGET_MEDIAN, TARGET_MAX = 0.10, 0.25


@dataclass
class Row:
    """One published run (the CSV's columns, typed)."""

    source: str
    model: str
    gpus: int
    device: str
    precision: str
    compile: bool
    seq: int
    global_batch: int
    mbs: int | None
    dp: int
    fsdp: bool
    tp: int
    pp: int
    vpp: int | None
    cp: int
    schedule: str
    recompute: str
    tokens_per_s_per_gpu: float | None
    note: str

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    def published_tflops(self) -> float | None:
        """'published 430 TFLOP/s/GPU' in the note, else None."""
        words = self.note.replace("/", " ").split()
        for i, w in enumerate(words[:-1]):
            if words[i + 1] == "TFLOP" and w.replace(".", "").isdigit():
                return float(w)
        return None


def read_rows(path: Path = CSV_PATH) -> list[Row]:
    """The CSV's rows (comment lines start with '#'); blank cells become None / defaults."""
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    out = []
    for rec in csv.DictReader(lines):
        num = lambda k: int(rec[k]) if rec[k].strip() else None  # noqa: E731
        out.append(Row(source=rec["source"], model=rec["model"], gpus=int(rec["gpus"]), device=rec["device"],
                       precision=rec["precision"], compile=rec["compile"] == "1", seq=int(rec["seq"]),
                       global_batch=int(rec["global_batch"]), mbs=num("mbs"), dp=int(rec["dp"]),
                       fsdp=rec["fsdp"] == "1", tp=int(rec["tp"]), pp=int(rec["pp"]), vpp=num("vpp"),
                       cp=int(rec["cp"]), schedule=rec["schedule"].strip(),
                       recompute=rec["recompute"].strip() or "none",
                       tokens_per_s_per_gpu=float(rec["tokens_per_s_per_gpu"]) if rec["tokens_per_s_per_gpu"].strip()
                       else None, note=rec["note"]))
    return out


def model_of(row: Row) -> ModelSpec:
    preset, changes = MODELS[row.model]
    return dataclasses.replace(load_model_spec(preset), seq_len=row.seq, **changes)


def cluster_of(row: Row) -> ClusterSpec:
    """The row's device preset at its host count; Transformer Engine stacks with their attention kernel's rate and
    their fused element-wise kernels; compile=1 rows with Inductor's fused element-wise kernels."""
    cluster = load_cluster_spec(DEVICES[row.device], nodes=max(1, row.gpus // DEVICES_PER_HOST),
                                devices_per_node=min(row.gpus, DEVICES_PER_HOST))
    if row.compile:
        cluster.device = dataclasses.replace(cluster.device, fused_elementwise=True)
    if row.source.startswith(TE_STACKS):
        if row.device != "h100-sxm":
            raise ValueError(f"{row.source}: TE attention figures are for the H100 SXM, not {row.device}")
        cluster.device = dataclasses.replace(cluster.device, **TE_ATTENTION, **TE_FUSIONS)
    return cluster


def plan_of(row: Row) -> tuple[Plan, list[str]]:
    """The row's stated layout as a Plan, and the assumptions made where the row is silent."""
    assumed = []
    interleaved = row.schedule == "interleaved" or (row.vpp or 1) > 1
    vpp = row.vpp or 1
    if interleaved and row.vpp is None:
        vpp = UNSTATED_VPP
        assumed.append(f"vpp={vpp}")
    mbs = row.mbs
    if mbs is None:
        mbs = 1 if is_meta(row) else max(1, row.local_batch // row.pp)  # see the module docstring
        assumed.append(f"mbs={mbs}")
    prec = "fp8-mixed" if row.precision == "fp8" else "bf16-mixed"
    zero = (2 if is_meta(row) else 3) if row.fsdp else 1
    plan = Plan(dp=row.dp, zero=zero, tp=row.tp, sp=row.tp > 1, pp=row.pp,
                schedule="interleaved" if interleaved else "1f1b", vpp=vpp, cp=row.cp, mbs=mbs,
                grad_accum=row.local_batch // mbs, recompute=row.recompute, precision=prec)
    return plan, assumed


def is_meta(row: Row) -> bool:
    """The Llama 3 paper's own stack (its s. 3.3.2), not torchtitan."""
    return row.source.startswith("Llama 3")


def published_step(row: Row, model: ModelSpec) -> float:
    """Seconds per step from the published throughput (tokens/s/GPU, or TFLOP/s/GPU with the FLOPs per token)."""
    tokens = row.global_batch * row.seq
    if row.tokens_per_s_per_gpu:
        return tokens / (row.tokens_per_s_per_gpu * row.gpus)
    tflops = row.published_tflops()
    if tflops is None:
        raise ValueError(f"row {row.source} / {row.model}: neither tokens/s nor TFLOP/s published")
    return tokens * C.model_flops_per_token(model, row.seq) / (tflops * 1e12 * row.gpus)


def predict(row: Row, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> tuple[float, PricedPlan]:
    """(step seconds, priced plan) of the row's layout; Transformer Engine stacks with tp > 1 less the TP traffic
    their userbuffers overlap hides (tp_overlap_hidden).

    torchtitan's "selective" is per-layer selective AC (``selective_ac_option = "2"``): every 2nd block is wrapped
    in full activation checkpointing, the others keep everything. A pp=1 step is a sum over blocks, so it is the
    mean of the step with recompute none and with recompute full (plans the planner prices); other rows: one plan.
    """
    if row.source.startswith("torchtitan") and plan.recompute == "selective" and plan.pp == 1:
        none, full = (estimate_fixed(row, model, cluster, dataclasses.replace(plan, recompute=rc))
                      for rc in ("none", "full"))
        return (none.step_time_s + full.step_time_s) / 2, full
    priced = estimate_fixed(row, model, cluster, plan)
    hidden = tp_overlap_hidden(model, cluster, plan, row.seq) if row.source.startswith(TE_STACKS) else 0.0
    return priced.step_time_s - hidden, priced


def tp_overlap_hidden(model: ModelSpec, cluster: ClusterSpec, plan: Plan, seq: int) -> float:
    """Seconds per step of tensor-parallel traffic that Transformer Engine's userbuffers overlap hides.

    The planner exposes each block's four TP collectives in full (``cost_comm.tp_comm_per_block``: with SP, all-gather
    before qkv and up, reduce-scatter after out and down, a quarter of its time each; the same backward), as
    autopar's DTensor runtime runs them. Userbuffers splits each into tp chunks pipelined against the GEMM that consumes (AG) or produces (RS)
    it (Wang et al. 2023, "Overlap communication with dependent computation via decomposition"; TE
    ``initialize_ub``), so per collective c against its GEMM's time W: exposed = cost_comm.overlapped_exposed(c, W,
    c/tp, comm_sm) -- one chunk cannot overlap, and the communication kernels hold the device's comm_sm share of
    the SMs. Hidden = span * blocks * sum(c - exposed), span = ga + (pp-1)/vpp micro-batch slots (the step's
    assembly in planner.search) and blocks = ceil(layers / pp) on the busiest rank; full recompute re-runs the
    forward collectives.
    """
    if plan.tp <= 1 or not plan.sp:  # userbuffers overlap runs with sequence parallelism only (TE ub_tp_comm_overlap)
        return 0.0
    hw = C.Hardware.from_cluster(cluster)
    prec = C.prec_index(plan.precision)
    peak, elem = hw.peak[C.BASE_PREC[prec]], C.ACT_BYTES[prec]
    gp = C.gemm_peak(hw, peak, prec == C.FP8)
    T, tp, h = plan.mbs * seq / plan.cp, plan.tp, model.hidden
    kvd, f = model.kv_heads * model.head_dim, model.ffn_hidden
    q, kv = C.gemm_fwd_bwd(hw, T, h / tp, h, gp, elem), C.gemm_fwd_bwd(hw, T, kvd / tp, h, gp, elem)
    up = C.gemm_fwd_bwd(hw, T, f / tp, h, gp, elem)
    windows = [(q[0] + 2 * kv[0], q[1] + 2 * kv[1]),  # AG -> qkv
               C.gemm_fwd_bwd(hw, T, h, h / tp, gp, elem),  # out -> RS
               ((model.ffn_matrices - 1) * up[0], (model.ffn_matrices - 1) * up[1]),  # AG -> up (and gate)
               C.gemm_fwd_bwd(hw, T, h, f / tp, gp, elem)]  # down -> RS
    # tp_comm_per_block: 2 all-reduce volumes per direction = 2 AG + 2 RS, each half an all-reduce (ring AR = RS + AG)
    one_f, one_b = (float(c) / 4 for c in C.tp_comm_per_block(hw, model, plan.mbs, seq, tp, plan.cp, elem))
    saved_f = sum(one_f - float(C.overlapped_exposed(one_f, w[0], one_f / tp, hw.comm_sm)) for w in windows)
    saved_b = sum(one_b - float(C.overlapped_exposed(one_b, w[1], one_b / tp, hw.comm_sm)) for w in windows)
    span = plan.grad_accum + (plan.pp - 1) / plan.vpp
    blocks = -(-model.layers // plan.pp)
    return span * blocks * (saved_f * (2 if plan.recompute == "full" else 1) + saved_b)


def estimate_fixed(row: Row, model: ModelSpec, cluster: ClusterSpec, plan: Plan) -> PricedPlan:
    """planner.search.estimate on the fixed plan; when pp*vpp does not divide the layers (Megatron's embedding and
    loss stages), the same pricing calls estimate() makes after its divisibility check."""
    if model.layers % (plan.pp * plan.vpp) == 0:
        return S.estimate(model, cluster, plan, global_batch=row.global_batch, seq_len=row.seq)
    plan.validate(world_size=cluster.world_size, global_batch=row.global_batch)
    hw = C.Hardware.from_cluster(cluster)
    space = space_from_plans([plan])
    costs = S.price(model, hw, space, row.global_batch, row.seq)
    return S.priced_plan(model, cluster, hw, space, costs, 0, row.global_batch, row.seq, hw.capacity * 0.9)


@dataclass
class Result:
    row: Row
    plan: Plan
    assumed: list[str]
    published_s: float
    predicted_s: float
    priced: PricedPlan

    @property
    def mfu(self) -> float:
        """Model FLOPs per second per device over the precision's peak, at the predicted step."""
        return self.priced.mfu * self.priced.step_time_s / self.predicted_s

    @property
    def error(self) -> float:
        return self.predicted_s / self.published_s - 1.0


def run(path: Path = CSV_PATH) -> list[Result]:
    out = []
    for row in read_rows(path):
        model, cluster = model_of(row), cluster_of(row)
        plan, assumed = plan_of(row)
        step, priced = predict(row, model, cluster, plan)
        out.append(Result(row, plan, assumed, published_step(row, model), step, priced))
    return out


def summary(results: list[Result]) -> dict[str, float]:
    """Median and max |error| over the rows priced as published (compile=0) and over the compile=1 rows."""
    main = [abs(r.error) for r in results if not r.row.compile]
    comp = [abs(r.error) for r in results if r.row.compile]
    return {"median": statistics.median(main), "max": max(main), "n": len(main),
            "compile_median": statistics.median(comp) if comp else 0.0, "compile_max": max(comp, default=0.0),
            "compile_n": len(comp)}


def table(results: list[Result]) -> str:
    """A markdown table, one line per row."""
    head = ("| # | source | model | GPUs | device | prec | layout priced | published s | predicted s | error | MFU |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for i, r in enumerate(results, 1):
        extra = (" (per-layer AC: every 2nd block full)" if r.priced.plan.recompute != r.plan.recompute else "") + \
                (" (assumed " + ", ".join(r.assumed) + ")" if r.assumed else "") + \
                (" [compile=1: fused element-wise]" if r.row.compile else "")
        lines.append(f"| {i} | {r.row.source.split(' (')[0]} | {r.row.model} | {r.row.gpus} | {r.row.device} | "
                     f"{r.row.precision} | {r.plan.short()}{extra} | {r.published_s:.3f} | {r.predicted_s:.3f} | "
                     f"{100 * r.error:+.1f}% | {100 * r.mfu:.1f}% |")
    s = summary(results)
    lines.append("")
    lines.append(f"compile=0 rows ({s['n']}): median |error| {100 * s['median']:.1f}%, max {100 * s['max']:.1f}% "
                 f"(targets {100 * TARGET_MEDIAN:.0f}% / {100 * TARGET_MAX:.0f}%); compile=1 rows ({s['compile_n']}, "
                 f"element-wise ops fused, else as compile=0): median {100 * s['compile_median']:.1f}%, "
                 f"max {100 * s['compile_max']:.1f}%.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=CSV_PATH)
    ap.add_argument("--breakdown", action="store_true", help="also print each row's compute/recompute/comm/bubble")
    args = ap.parse_args(argv)
    results = run(args.csv)
    print(table(results))
    if args.breakdown:
        for i, r in enumerate(results, 1):
            b = r.priced.breakdown
            hidden = tp_overlap_hidden(model_of(r.row), cluster_of(r.row), r.plan, r.row.seq) \
                if r.row.source.startswith(TE_STACKS) else 0.0
            print(f"{i:2d} compute {b.compute_s:.3f} recompute {b.recompute_s:.3f} comm {b.comm_exposed_s:.3f} "
                  f"(TP overlap hides {hidden:.3f}) bubble {b.bubble_s:.3f} "
                  f"mem {r.priced.memory_gib_per_device:.1f} GiB")


if __name__ == "__main__":
    main()
