"""The third-party model matrix of issue 12: models written by others train under autopar exactly as on one device.

Rows: Hugging Face GPT-2 (tied lm_head), Llama, Mixtral, Qwen2, Phi-3, OLMoE (q/k norms over the full projection
width); litgpt's GPT dense and MoE; a nanoGPT-style model (one fused c_attn, tied wte/lm_head), a plain-loop MoE,
Hugging Face BERT (masked LM, decoder tied to the word embeddings) and Hugging Face ViT (image classification,
Conv2d patch embedding) (tests/dist/third_party_models.py); issue 26: a torchtitan-style Llama and MoE (blocks
in a ModuleDict, an autocast router), a CIFAR-size BatchNorm ResNet (HF, 32x32, last map 1x1), a two-tower model
with frozen and unused parameters, a Llama with frozen lower layers (zero3, tp2, pp2 only), torchtitan's
own MoE layout (router module, 3-D GroupedExperts), Qwen2-MoE at its default config (no
router logits; ep2 only), OLMoE and Mixtral at their default configs (auto, ep2), a model whose forward does not run on meta tensors,
the encoder-decoders Hugging Face BART, Whisper (a Conv1d front-end on log-mel features), T5 and Switch
Transformers (T5 with top-1 MoE layers), LLaVA (a vision-language model), Qwen3-MoE (per-head q/k norms),
GPT-OSS (per-layer attention kinds) and GPT-NeoX (q, k, v fused and interleaved per head).
Columns: the planner's own plan, zero=3 (dp=4), tp=2 (dp=2), ep=2 (dp=4, MoE rows) and pp=2 (dp=2). In the suite the
cells run in the batch of world 4 (tests/conftest.py: one launch per world size); ``--run`` below launches them
alone (tests/dist/third_party_scenarios.py).

Every cell either trains equal to the plain single-process loop (losses per step and final parameters within
LOSS_RTOL / PARAM_RTOL + PARAM_ATOL of tests/test_strategy.py, fp32) with the plan it was asked for, or, where the
structure does not allow the plan, is refused with one line naming the module and the fix, and the planner's own
plan for that model shows the reason in the plan report (``report.excluded``).

The table: ``python tests/test_third_party.py --run OUT_DIR`` launches the matrix and prints model x plan ->
equal / refused(reason) / FAIL(first error line); ``--table OUT_DIR`` prints it for an earlier launch's outputs;
``--models bert,vit`` after either runs / prints those rows only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

DIST = Path(__file__).resolve().parent / "dist"
sys.path.insert(0, str(DIST))

from common import reference_run  # noqa: E402
from conftest import ROOT, free_port, run_scenarios  # noqa: E402
from conftest import kill_launch as _kill_launch, last_error_line as _last_error_line  # noqa: E402
from test_strategy import LOSS_RTOL, PARAM_ATOL, PARAM_RTOL  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

from third_party_models import MODELS, cell_dtype  # noqa: E402
from third_party_scenarios import PLAN_FIELD, PLANS, STEPS, cells  # noqa: E402

EQUAL, REFUSED = "equal", "refused"
# What the issue demands of each cell: equal to one device wherever the structure allows the plan. Refused only
# where it cannot: a pipeline split cannot keep a tied embedding / head pair on one stage ("a plan that cannot
# keep a tie is not offered"), and attention code that takes its sizes from the full width cannot run on a TP
# rank's local heads: nanoGPT's ``C // self.n_head`` (C the input width). litgpt's own split of its fused GQA
# [q|k|v] works on local heads (TP splits it row-permuted, parallel.row_order.RowOrder), and its MoE model has the
# same attention, so both are expected equal. OLMoE's q/k norms run over the full projection width: the issue
# accepts either TP keeping them exact or the planner restricting tp with a reason. BERT (an encoder: its
# attention output projection and its MLP's second half sit in sibling modules, found from the traced dataflow)
# and ViT train equal at tp=2 (issue 13); BERT's decoder is tied to the word embeddings (no pp). ViT's CLS token
# and position embeddings (parameters outside the layers, in the embeddings module the traced call runs before
# them) go with the first stage, its final layernorm and classifier with the last: equal at pp=2.
# Issue 26's rows: torchtitan-style Llama and MoE (blocks in a ModuleDict, an autocast router) are transformers and
# equal at every column. The CIFAR-size ResNet is in unit form (tp: nothing to split) with BatchNorm (pp: a stage
# would normalise each micro-batch apart); its ga2 cell (4 values per channel on the 1x1 map) runs in float64, where
# it equals one device to 1e-14 (float32 rounding over so few values ends ~1e-5 apart); the two-tower model (unused
# and frozen parameters) is in unit form
# (tp); the pad-skipping model's forward does not run on meta tensors: data parallelism only (tp, pp refused).
# torchtitan's own MoE layout (a router module, GroupedExperts called with the tokens sorted by expert and the count
# per expert) is found as MoE with that call, which TP (inside each expert) and EP (the rows exchanged by expert)
# drive: equal at tp2 and ep2.
# The encoder-decoders (BART, Whisper: two block stacks, decoder cross-attention) train equal at tp=2 (the decoder's
# stack is split; Whisper's proj_out, tied to the decoder's embedding, is vocabulary-parallel); pp=2 is refused: the
# embedding is tied across the stacks and the head (BART: one ``shared`` table for encoder, decoder and lm_head;
# Whisper: decoder embedding and proj_out), which no pipeline stage holds for all its users.
# T5 (one ``shared`` table held by the encoder's and the decoder's embed_tokens and the head, a relative position
# bias per head) trains equal at tp=2 (the bias sharded with the heads; every module holding the shared table
# looks up through its vocabulary shards); pp=2 is refused for that tie, as BART's.
# Qwen3-MoE (q/k norms over head_dim on each head: one weight for all heads, whose gradient TP sums over the TP group)
# trains equal at every column.
# GPT-OSS (sliding and full attention alternating by ``config.layer_types[i]``, i the block's position in the model's
# loop; attention sinks, one parameter per head; fused experts with gate and up interleaved and a bias of each
# projection) trains equal at every column: a pipeline stage reads its own blocks' entries (before: stage 1's first
# block took layer 0's sliding window, 3e-4 off at step 0); its sinks are split with the heads; TP splits the
# experts' interleaved gate/up contiguously (the probe on their forward says which cut is exact), their input
# bias with it, and adds the output bias once (TP rank 0).
# Switch Transformers (T5's encoder-decoder, a top-1 MoE every other block: a ModuleDict of experts with a forward of
# its own, called with a one-hot dispatch mask; capacity drops tokens per sequence) is found as MoE from its routing
# (the experts loop, data-dependent, runs on meta as each expert on its expected rows) and trains equal at auto and
# zero3 (ep=2: the user's dispatch over every expert's call slot), tp2 and ga2 (ep=1: an expert a rank's micro-batch
# skips still takes a zero gradient, so the ranks reduce the same tensors); pp=2 is refused for T5's tie.
# LLaVA (a frozen CLIP tower, a projector, a Llama text model; the tower's post_layernorm unused) trains equal at
# every column: tp2 splits the text model's stack; pp2 splits it too, the user's call traced (token ids alone never
# reach the tower) shows the tower and the projector run before it, so the first stage owns them and the others
# run zeros of their outputs' shapes.
# LLaVA with its tower trained, on batches where some rows have no image (llava_mixed): one rank's second batch
# has none, so it skips the tower and the projector. The token-id trace never reaches them: DDP (auto) is told to
# find unused parameters and trains equal; FSDP (zero3) would reduce different gradients on each rank (gloo
# aborted), so the ranks compare what ran after each forward and refuse in one line (parallel/unreached.py).
# GPT-NeoX (one query_key_value viewed as (heads, 3 * head_dim), then chunked: q, k and v interleaved per head) is
# equal at tp2: a contiguous split of the fused rows gives each rank whole heads.
REFUSALS = {"gpt2__pp2", "nanogpt__pp2", "nanogpt__tp2", "bert__pp2", "resnet__tp2", "resnet__pp2", "two_tower__tp2",
            "pad_skipping__tp2", "pad_skipping__pp2", "bart__pp2", "whisper__pp2", "t5__pp2",
            "switch__pp2", "llava_mixed__zero3"}
# refused at the step where the data-parallel ranks' batches disagree on what ran: the data's, which the planner
# cannot know (its own plan shows no reason for them)
DATA_REFUSALS = {"llava_mixed__zero3"}
EITHER = {"olmoe__tp2"}
EXPECTED: dict[str, str | set[str]] = {
    cell: (REFUSED if cell in REFUSALS else {EQUAL, REFUSED} if cell in EITHER else EQUAL) for cell in cells()}

WORLD = 4
LAUNCH_TIMEOUT_S = 2700  # the whole matrix, relaunches included (about 90 cells; 20+ min on a loaded machine)
STALL_S = 300  # no cell finished for this long: the launch hangs; the running cell is recorded as failed


# ------------------------------------------------------------------------------------------- launching


def _recorded(out: Path, cell: str) -> bool:
    return (out / f"{cell}.pt").exists()


def launch_matrix(out: Path, names: list[str]) -> None:
    """Run ``names`` under one torchrun launch of world 4; when a launch dies or stalls (a rank hung in a
    collective), record the cell it was in as failed with the log's last error line and relaunch the cells not
    yet run, so one broken cell never hides the others. A launch that gets no cell done ends the matrix (the
    cells left are reported as not run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # as conftest.torchrun
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while (todo := [n for n in names if not _recorded(out, n)]) and time.monotonic() < deadline:
        log_path = out / f"launch_{len(list(out.glob('launch_*.log')))}.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(DIST / "third_party_scenarios.py"), str(out),
               ",".join(todo)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            last_progress, done = time.monotonic(), sum(_recorded(out, n) for n in todo)
            while proc.poll() is None:
                time.sleep(1)
                now_done = sum(_recorded(out, n) for n in todo)
                if now_done != done:
                    last_progress, done = time.monotonic(), now_done
                if time.monotonic() - last_progress > STALL_S or time.monotonic() > deadline:
                    _kill_launch(proc)
                    break
        log_text = log_path.read_text(errors="replace")
        reason = "stalled" if proc.returncode == -signal.SIGKILL else f"exit {proc.returncode}"
        failed = {"crash": log_text[-8000:], "first_line": f"launch {reason}: {_last_error_line(log_text)}"}
        for cell in todo:
            if (out / f"{cell}.started").exists() and not _recorded(out, cell):
                torch.save(failed, out / f"{cell}.pt")
        if not any(_recorded(out, cell) for cell in todo):
            (out / "not_run.txt").write_text(failed["first_line"])
            break  # not one cell got done or blamed: relaunching would fail the same way


@pytest.fixture(scope="module")
def matrix_out(tmp_path_factory):
    """The cells' outputs: in the suite's batch of world 4 (conftest.run_scenarios)."""
    return run_scenarios(tmp_path_factory, WORLD, cells(), script="third_party_scenarios.py")


@pytest.fixture(scope="module")
def matrix(matrix_out):
    out = matrix_out
    yield out
    # the table for the closing note (shown with -s; also in OUT/table.txt)
    summary = table(out)
    (out / "table.txt").write_text(summary + "\n")
    print(f"\nthird-party matrix ({out}):\n{summary}")


# ------------------------------------------------------------------------------------------- judging


_REFERENCES: dict[tuple[str, int, int, torch.dtype], tuple[list[float], dict]] = {}


def reference(model: str, plan: dict, column: str = "") -> tuple[list[float], dict]:
    """The single-process loop for ``model`` (in the dtype of its ``column``'s cell). A balance loss is not a sum
    over rows, so for such a model the reference takes the plan's micro-batches (the m-th slice of every
    data-parallel slice) as one step does."""
    with cell_dtype(model, column):
        shape = (plan["dp"], plan["grad_accum"]) if MODELS[model].balance_loss else (1, 1)
        key = (model, *shape, torch.get_default_dtype())
        if key not in _REFERENCES:
            _REFERENCES[key] = reference_run(STEPS, make=MODELS[model].make, dp=shape[0], micro_batches=shape[1])
    return _REFERENCES[key]


def load_cell(out: Path, cell: str) -> dict:
    path = out / f"{cell}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    why = out / "not_run.txt"
    return {"first_line": "not run" + (f": {why.read_text()}" if why.exists() else ""), "crash": ""}


def mismatch(result: dict, ref_losses: list[float], ref_state: dict) -> str | None:
    """Why ``result`` is not single-device training (first line), or None when it is, within the tolerances."""
    losses = result["losses"]
    if len(losses) != STEPS:
        return f"{len(losses)} logged losses for {STEPS} steps"
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        if abs(got - want) > LOSS_RTOL * abs(want):
            return f"loss at step {step} {got:.6f} vs {want:.6f} (rel {abs(got - want) / abs(want):.1e})"
    state = result["state"]
    if set(state) != set(ref_state):
        return f"state names differ: missing {sorted(set(ref_state) - set(state))[:3]}, " \
               f"extra {sorted(set(state) - set(ref_state))[:3]}"
    for name, ref in ref_state.items():
        got = state[name]
        if got.shape != ref.shape:
            return f"parameter {name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
        if not torch.allclose(got, ref, rtol=PARAM_RTOL, atol=PARAM_ATOL):
            return f"parameter {name}: max abs diff {(got - ref).abs().max().item():.1e}"
    return None


def pinned_fields(column: str) -> dict[str, int]:
    """The fields a plan column fixes, e.g. {"tp": 2, "dp": 2}."""
    fix = PLANS[column]
    return {} if fix is None else {k: int(v) for k, v in (item.split("=") for item in fix.split(","))}


def outcome(out: Path, cell: str) -> tuple[str, str]:
    """(equal | refused | FAIL, detail) for one cell of a launch's outputs."""
    model, column = cell.split("__")
    result = load_cell(out, cell)
    if "crash" in result:
        return "FAIL", result.get("first_line") or result["crash"][-2000:] or "crashed"
    if "error" in result:
        error = result["error"]
        if "\n" in error or "Traceback" in error or "fix" not in error:
            return "FAIL", f"refusal is not one line with a fix: {error[:300]!r}"
        if "failed" in error:  # e.g. "needs the meta trace, which failed": the analysis, not the structure
            return "FAIL", f"refused because the analysis failed, not for the model's structure: {error}"
        return REFUSED, error
    wrong = {k: result["plan"].get(k) for k, v in pinned_fields(column).items() if result["plan"].get(k) != v}
    if wrong:
        return "FAIL", f"plan {result['plan']} ignores the pinned {wrong}"
    why = mismatch(result, *reference(model, result["plan"], column))
    return ("FAIL", f"not equal to one device: {why}") if why else (EQUAL, _short_plan(result["plan"]))


def _short_plan(plan: dict) -> str:
    keys = ("dp", "zero", "tp", "pp", "ep", "mbs", "grad_accum", "recompute")
    return ",".join(f"{k}={plan[k]}" for k in keys if k in plan)


def _expected(cell: str) -> set[str]:
    want = EXPECTED[cell]
    return want if isinstance(want, set) else {want}


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("cell", cells())
def test_cell(matrix, cell):
    """Equal to one device (with the plan asked for), or refused in one line with a fix where the issue allows."""
    status, detail = outcome(matrix, cell)
    assert status in _expected(cell), f"{cell}: expected {' or '.join(sorted(_expected(cell)))}, got {status}: {detail}"


@pytest.mark.parametrize("model", [m for m, info in MODELS.items() if "auto" not in info.not_run])
def test_own_plan_reports_what_it_excludes(matrix, model):
    """The planner's own plan shows a reason for every field the model cannot use: ep without MoE layers, and
    the field of every column refused for it (so nothing a forced plan refuses is silently left out)."""
    result = load_cell(matrix, f"{model}__auto")
    assert "crash" not in result and "error" not in result, result.get("first_line") or result.get("error")
    excluded = result["excluded"]
    assert all(isinstance(r, str) and r.strip() for r in excluded.values()), excluded
    must = {"ep"} if not MODELS[model].moe else set()
    must |= {PLAN_FIELD[column] for column in PLANS if column in PLAN_FIELD
             and f"{model}__{column}" not in DATA_REFUSALS and outcome(matrix, f"{model}__{column}")[0] == REFUSED}
    assert must <= set(excluded), f"{model}: no reason shown for {sorted(must - set(excluded))}: {excluded}"


# ------------------------------------------------------------------------------------------- the table


def table(out: Path, models: list[str] | None = None) -> str:
    """model x plan -> equal / refused / FAIL, then one line per cell that is not equal (its reason), with a
    "!" where the outcome is not what EXPECTED demands; the rows of ``models`` only when given."""
    columns = list(PLANS)
    rows, notes = [], []
    width = max(len(m) for m in MODELS)
    rows.append(" " * width + " | " + " | ".join(f"{c:<9}" for c in columns))
    for model in (models or MODELS):
        marks = []
        for column in columns:
            cell = f"{model}__{column}"
            if cell not in EXPECTED:
                marks.append(f"{'-':<9}")
                continue
            status, detail = outcome(out, cell)
            flag = "" if status in _expected(cell) else "!"
            marks.append(f"{status + flag:<9}")
            if status != EQUAL:
                notes.append(f"{flag or ' '} {cell}: {status}({detail})")
        rows.append(f"{model:<{width}} | " + " | ".join(marks))
    return "\n".join(rows + [""] + notes)


def _cells_of(models: list[str] | None) -> list[str]:
    """The matrix's cells, or those of ``models`` only (rows being worked on)."""
    unknown = sorted(set(models or []) - set(MODELS))
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; the rows are {', '.join(MODELS)}")
    return [c for c in cells() if models is None or c.split("__")[0] in models]


if __name__ == "__main__":
    args = sys.argv[1:]
    rows = None
    if len(args) == 4 and args[2] == "--models":
        rows, args = args[3].split(","), args[:2]
    if len(args) != 2 or args[0] not in ("--run", "--table"):
        raise SystemExit("usage: python tests/test_third_party.py --run OUT_DIR | --table OUT_DIR [--models a,b]")
    out_dir = Path(args[1])
    if args[0] == "--run":
        out_dir.mkdir(parents=True, exist_ok=True)
        launch_matrix(out_dir, _cells_of(rows))
    print(table(out_dir, rows))
