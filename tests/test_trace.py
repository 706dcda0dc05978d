"""profile/trace.py: the one meta forward and its recorders, on small models (meta tensors only, one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_autopar.profile.trace import (BlockCost, Dataflow, OpCosts, ParameterUses, StopAtCall, StopAtModule,
                                             meta_example, meta_forward, token_ids)


class Attention(nn.Module):
    def __init__(self, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Attention() for _ in range(2))
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.unused = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_the_trace_records_modules_uses_attention_and_costs_without_moving_the_model():
    model = Tiny()
    trace = meta_forward(model, token_ids(2, 8), [ParameterUses(), BlockCost(["blocks.0", "blocks.1"]),
                                                  Dataflow("blocks.0", weights=True)], backward=True)
    assert trace.failure is None
    assert trace.called[:3] == ["", "emb", "blocks.0"] and "unused" not in trace.called
    assert trace.unused == ["unused.weight", "unused.bias"]
    assert trace.attention == [("blocks.0", 2, 2, 8), ("blocks.1", 2, 2, 8)] and trace.attn_seq == 8
    assert trace.orientation["blocks.0.q"] is False  # nn.Linear: weight stored [out, in]
    assert trace.probe is not None and trace.probe.out_shapes["blocks.0.o"] == (2, 8, 16)
    assert trace.flops["blocks.0"] == trace.flops["blocks.1"] > 0 and trace.saved["blocks.0"] > 0
    assert trace.output_shape == (2, 8, 32)
    # forward + backward: 3x the forward's four projections (16 tokens, 16 -> 16) and attention on top
    assert trace.flops["blocks.0"] > 3 * 4 * 2 * 16 * 16 * 16 and trace.total_flops > sum(trace.flops.values())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_uses_are_recorded_under_every_name_of_a_tied_parameter():
    model = Tiny()
    trace = meta_forward(model, token_ids(1, 4), [ParameterUses(stacks=True)], grad=False, every_name=True,
                         prefix="model")
    assert trace.uses["model.emb.weight"] == trace.uses["model.head.weight"] == [("model", "model.emb"),
                                                                                ("model", "model.head")]
    assert "model.blocks.0" in trace.called and "model.unused.weight" not in trace.uses


def test_op_costs_are_charged_to_the_running_module_forwards():
    model = Tiny()
    trace = meta_forward(model, meta_example(((torch.zeros(3, 4, dtype=torch.long),), {}), rows=1), [OpCosts()],
                         grad=True)
    assert trace.failure is None
    assert trace.costs[("", "blocks.0", "blocks.0.q")].flops == 2 * 4 * 16 * 16  # one row of 4 tokens
    assert "attention" in trace.costs[("", "blocks.0")].kinds
    assert trace.outputs["head"] == 4 * 32 * 4  # bytes at 4-byte elements


def test_a_model_not_running_on_meta_tensors_gives_a_failure_not_an_error():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x[torch.nonzero(x[:, 0] > 0).squeeze(1)])

    trace = meta_forward(DataDependent(), meta_example(((torch.ones(2, 4),), {})), [ParameterUses()])
    assert trace.failure is not None and trace.failure.startswith("NotImplementedError") and trace.unused == []
    # a block standing in as identity lets the rest of the forward run
    model = nn.Sequential(DataDependent(), nn.Linear(4, 2))
    trace = meta_forward(model, meta_example(((torch.ones(2, 4),), {})), stand_in=[model[0]])
    assert trace.failure is None and trace.stood_in and trace.output_shape == (2, 2)


def test_stop_at_module_stops_the_forward_with_its_call_and_is_a_base_exception():
    model = Tiny()
    trace = meta_forward(model, token_ids(1, 4), [StopAtModule(model.blocks[1], "blocks.1")])
    assert trace.failure is None and trace.stopped is not None and trace.stopped.fqn == "blocks.1"
    assert trace.stopped.args[0].shape == (1, 4, 16) and trace.stopped.args[0].device.type == "meta"
    assert "blocks.1" not in trace.called and "head" not in trace.called
    assert not issubclass(StopAtCall, Exception)


def test_meta_kernel_cache_answers_repeats_as_the_kernel_does():
    """A repeated op on meta tensors of the same metadata is answered from the recorded outputs: the same shapes,
    strides, dtypes and storage sizes as the kernel's, fresh tensors; views and in-place ops run as usual."""
    import torch.nn.functional as F

    from lightning_autopar.profile.meta_kernels import MetaKernelCache

    def meta(*shape, **kw):
        return torch.empty(*shape, device="meta", **kw)

    x, w = meta(2, 8, 5, 5).to(memory_format=torch.channels_last), meta(8)
    calls = [lambda: F.batch_norm(x, meta(8), meta(8), w, meta(8), training=True),
             lambda: F.relu(x), lambda: x + 1, lambda: x + 1.0, lambda: torch.add(x, meta(8, 1, 1, dtype=torch.half)),
             lambda: F.conv2d(x, meta(4, 8, 3, 3), padding=1), lambda: x.permute(0, 2, 3, 1), lambda: x[:, :2],
             lambda: meta(3).add_(1), lambda: torch.cat((x, x))]

    def described(out):
        outs = out if isinstance(out, tuple) else (out,)
        return [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()) for t in outs]

    expected = [described(c()) for c in calls]
    MetaKernelCache.outputs.clear()  # a cache: what other tests recorded is dropped, not changed
    with MetaKernelCache():
        first = [described(c()) for c in calls]
        again = [c() for c in calls]
    assert first == expected and [described(o) for o in again] == expected
    assert again[6].untyped_storage()._cdata == x.untyped_storage()._cdata  # a view still aliases its input
    assert MetaKernelCache.outputs  # the repeats were answered from the record
    relu = next(k for k in MetaKernelCache.outputs if k[0] is torch.ops.aten.relu.default)
    assert MetaKernelCache.outputs[relu][0][1] == x.stride()  # channels-last kept
