"""Hugging Face Trainer scenarios under torchrun (issue 31): ``lightning_autopar.hf_trainer.AutoparTrainer`` training
a tiny HF Llama with the Trainer's own loop (``use_cpu=True``: Accelerate's MULTI_CPU on gloo).

Usage: torchrun --nproc-per-node N tests/dist/hf_trainer_scenarios.py OUT_DIR name[,name...]
Each scenario writes OUT_DIR/<name>.pt on rank 0: the Trainer's logged loss of every optimizer step, the full final
state dict (single-device names), the plan and the rows one step took, or the traceback it crashed with.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from pp_scenarios import gathered_state  # noqa: E402
from scenarios import main, record  # noqa: E402

PER_DEVICE = 2  # rows per data-parallel rank and micro-batch
HF_STEPS = 4
CLIP = 0.05  # small enough that every step clips
SCENARIOS = {  # name -> (fix, gradient_accumulation_steps, max_grad_norm)
    "hft_auto": (None, 2, CLIP),  # the planner's plan, two micro-batches per step, clipped
    # FSDP2 over every rank, no clipping, the user's own optimizer (Trainer(optimizers=...)); then trainer.evaluate()
    "hft_zero3": ("dp={w},zero=3", 1, 0.0),
    # tp=2 x dp=2 with FSDP2: DTensor gradients on two meshes clipped by autopar's clip, the token count per dp rank
    "hft_tp2_zero3": ("tp=2,dp=2,zero=3", 1, CLIP),
}
OWN_OPTIMIZER = {"hft_zero3"}


def make_llama() -> torch.nn.Module:
    """The tiny HF Llama of tests_hf (seeded), without its LightningModule."""
    import lightning.pytorch as L

    from tests_hf import make_hf_module

    L.seed_everything(0, verbose=False)
    return make_hf_module().model


class TokenRows(torch.utils.data.Dataset):
    """common.make_data's token windows as the Trainer's dict rows (labels = inputs: the model shifts them)."""

    def __init__(self) -> None:
        from common import make_data

        self.tokens = make_data().tensors[0]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def trainer_run(out: Path, fix: str | None, accumulate: int, clip: float,
                own_optimizer: bool = False) -> tuple[torch.nn.Module, list, dict, float, int]:
    """AutoparTrainer on the tiny Llama: SGD at a constant rate (the Trainer's, or with ``own_optimizer`` one built
    on the model before the plan replaced its parameters), the rows in order; (model, losses, plan, the evaluation
    loss over every row after training, the rows of one step as the Trainer counts them)."""
    from transformers import TrainerCallback, TrainingArguments

    from lightning_autopar.hf_trainer import AutoparTrainer

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = TrainingArguments(output_dir=str(out / "hft"), per_device_train_batch_size=PER_DEVICE,
                             gradient_accumulation_steps=accumulate, max_steps=HF_STEPS, learning_rate=0.1,
                             optim="sgd", lr_scheduler_type="constant", max_grad_norm=clip, logging_steps=1,
                             save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                             train_sampling_strategy="sequential", dataloader_drop_last=True,
                             per_device_eval_batch_size=PER_DEVICE)
    model = make_llama()
    optimizers: tuple = (None, None)
    if own_optimizer:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    trainer = AutoparTrainer(model, args, train_dataset=TokenRows(), callbacks=[Losses()], optimizers=optimizers,
                             fix=fix, planner_options={"cluster": "cpu", "print_plan": False})
    trainer.train()
    evaluated = trainer.evaluate(eval_dataset=TokenRows())["eval_loss"]  # over the plan's dp ranks
    return model, losses, trainer.autopar.plan.to_dict(), evaluated, trainer.get_total_train_batch_size(args)


def run(out: Path, name: str) -> None:
    import os

    world = int(os.environ["WORLD_SIZE"])
    if name not in SCENARIOS:
        raise SystemExit(f"unknown scenario {name}")
    fix, accumulate, clip = SCENARIOS[name]
    model, losses, plan, evaluated, counted = trainer_run(out, fix and fix.format(w=world), accumulate, clip,
                                                          name in OWN_OPTIMIZER)
    record(out, name, losses=losses, state=gathered_state(model), plan=plan, eval_loss=evaluated,
           rows=PER_DEVICE * plan["dp"] * accumulate, trainer_rows=counted)


if __name__ == "__main__":
    main(run)
