"""Trial runs under torchrun (``runtime.trial``): plan P run for a few steps on the live process group.

Usage: torchrun --nproc-per-node N tests/dist/runtime_scenarios.py OUT_DIR
Each rank writes OUT_DIR/trial_r<rank>.pt: per plan the measured step times, and whether the module's
parameters, the RNG states and the process group's sub-groups were as before the trials (or the traceback);
then it leaves collectives unwaited and exits (unwaited_collectives_at_exit: the launch must still exit 0).

       torchrun --nproc-per-node 2 --max-restarts 1 tests/dist/runtime_scenarios.py OUT_DIR stopped
A stopped peer: strategy timeout 20 s, checkpoints every 2 steps, rank 1 SIGSTOPs itself after step 3 (once:
OUT_DIR/stopped.flag). Rank 0 names it and exits; torchrun restarts the job, which resumes from step 2 and
writes OUT_DIR/stopped.pt (rank 0: where it resumed from, the restart count, the losses)."""

from __future__ import annotations

import random
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GLOBAL_BATCH, make_data, make_module  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PLANS = {"dp2_zero0": dict(dp=2, zero=0), "dp2_zero3": dict(dp=2, zero=3)}
STEPS = 2


def rng_fingerprint() -> tuple:
    return torch.get_rng_state().clone(), random.getstate()


def trial_result() -> dict:
    from lightning_autopar.runtime.trial import run_trial
    from lightning_autopar.specs import Plan

    torch.manual_seed(0)
    module = make_module()
    data = make_data()
    batches = [data[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH] for i in range(2)]
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    params = [id(p) for p in module.parameters()]
    rng = rng_fingerprint()
    out: dict = {"times": {}}
    for name, fields in PLANS.items():
        plan = Plan(**fields, mbs=GLOBAL_BATCH // fields["dp"], grad_accum=1)
        out["times"][name] = run_trial(module, plan, batches, STEPS, device=torch.device("cpu"))
    after = module.state_dict()
    out["params_unchanged"] = all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
    out["same_parameter_objects"] = params == [id(p) for p in module.parameters()]
    out["plain_tensors"] = all(type(p) is torch.nn.Parameter for p in module.parameters())
    now = rng_fingerprint()
    out["rng_unchanged"] = torch.equal(rng[0], now[0]) and rng[1] == now[1]
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the world group still works after the trials destroyed their sub-groups
    out["world_sum"] = float(probe)
    return out


def stopped_peer(out_dir: Path) -> None:
    import os
    import signal
    from datetime import timedelta

    import lightning.pytorch as L
    from scenarios import fit, record

    from lightning_autopar.callbacks import AutoCheckpoint

    class StopRank1(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            flag = out_dir / "stopped.flag"
            if trainer.global_step == 3 and trainer.global_rank == 1 and not flag.exists():
                flag.write_text("stopped")
                os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, the heartbeat too; torchrun kills it

    ckpt = AutoCheckpoint(out_dir / "ckpt", every_n_steps=2)
    _, _, losses, _ = fit("dp=2", steps=6, extra_callbacks=[ckpt, StopRank1()], enable_checkpointing=True,
                          strategy_kwargs={"timeout": timedelta(seconds=20)})
    record(out_dir, "stopped", resumed_from=str(ckpt.resumed_from), losses=losses,
           restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))


def main() -> None:
    out_dir = Path(sys.argv[1])
    if sys.argv[2:] == ["stopped"]:
        stopped_peer(out_dir)
        return
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = trial_result()
    except Exception:  # noqa: BLE001 - the test reports the traceback
        result = {"crash": traceback.format_exc()}
    torch.save(result, out_dir / f"trial_r{rank}.pt")
    unwaited_collectives_at_exit()
    dist.destroy_process_group()


def unwaited_collectives_at_exit() -> None:
    """Collectives still queued when the script ends, on a group the trials' mesh holds, their tensors already
    freed by Python: without the groups destroyed at exit (topology.worker.destroy_at_exit), a gloo worker drops
    them after the interpreter began finalizing and the process aborts ("terminate called without an active
    exception", -6; 3 of 3 runs here before the fix). The launch must exit 0."""
    from lightning_autopar.specs import Plan
    from lightning_autopar.topology.mesh import build_mesh

    group = build_mesh(Plan(dp=2, zero=3, mbs=1, grad_accum=1), "cpu")["dp_flat"].get_group()
    works = [dist.all_reduce(torch.ones(20000), group=group, async_op=True) for _ in range(20)]
    works[0].wait()


if __name__ == "__main__":
    main()
