"""Precision helpers: Lightning flag mapping and the rank-agreeing gradient scaler on DTensor gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_autopar.errors import ConfigError
from lightning_autopar.parallel.precision import ShardedGradScaler, mixed_precision_policy, plan_precision


def test_plan_precision_mapping():
    assert plan_precision("32-true") == "fp32"
    assert plan_precision("bf16-mixed") == "bf16-mixed" and plan_precision("16-mixed") == "fp16-mixed"
    with pytest.raises(ConfigError, match="Trainer.precision"):
        plan_precision("64-true")
    assert mixed_precision_policy("bf16-mixed").param_dtype == torch.bfloat16
    assert mixed_precision_policy("bf16-mixed").reduce_dtype == torch.float32


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_grad_scaler_unscales_dtensor_grads_and_skips_inf(single_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = ShardedGradScaler(device="cpu", init_scale=8.0)

    scaler.scale((param * 2).sum()).backward()
    scaler.step(opt)  # unscale: grad 2 per element, step with lr 1
    scaler.update()
    torch.testing.assert_close(param.full_tensor(), torch.full((4, 2), -1.0))

    opt.zero_grad()
    param.grad = distribute_tensor(torch.full((4, 2), float("inf")), mesh, [Shard(0)])
    scaler.step(opt)  # found inf: the step is skipped and the scale backs off
    scaler.update()
    torch.testing.assert_close(param.full_tensor(), torch.full((4, 2), -1.0))
    assert scaler.get_scale() < 8.0
