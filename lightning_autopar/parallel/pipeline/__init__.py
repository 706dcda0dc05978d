"""Pipeline parallelism: split the user's model into chunks and run them with torch.distributed.pipelining.

Two ways to split, one runtime. A transformer (a stack of blocks between embeddings and a final norm / LM head)
is split by swapping its blocks, and every chunk runs the user's own ``forward``; any other model that
``torch.export`` can trace is split in its traced graph at unit boundaries. Both run through the same schedule
and step (``StagedPipeline``). The strategy captures the user's model call per micro-batch and hands it to the
chunks; the user's ``training_step`` is not rewritten.

Modules, one concern each:

* ``partition``: what is split (``pipeline_root``), whether it can be (``check_pipeline``), which stage owns each
  part outside the blocks (``stage_parts``: from the model's traced call), blocks per chunk,
  which rank holds each chunk (``stage_owners``: round-robin or a V), what torch's schedule can run
  (``check_schedule``);
* ``standins``: parameter-free modules in place of what a chunk does not own (names stay the user's);
* ``moe``: MoE load-balancing values carried across stages to the user's loss on the last stage;
* ``chunks``: the block-stack chunks (``PipelineChunk``) and the split of the model (``split_model``);
* ``stage``: every use of torch's private pipelining API (the ``PipelineStage`` overrides, the graph splitter),
  with the torch version it was checked against;
* ``runtime``: the schedule, training step, forward-only pass and broadcast (``StagedPipeline``, ``Pipeline``);
* ``capture``: the user's model call, captured or answered (``capture_model_call``, ``model_call_replaced``);
* ``trace`` and ``traced``: models that are not a block stack (``trace_split``, ``TracedPipeline``).
"""

from lightning_autopar.parallel.pipeline.capture import capture_model_call, model_call_replaced
from lightning_autopar.parallel.pipeline.chunks import PipelineChunk, split_model
from lightning_autopar.parallel.pipeline.moe import MoESource, moe_sources, router_recorder
from lightning_autopar.parallel.pipeline.partition import (StageParts, check_pipeline, check_schedule, chunk_sizes,
                                                           pipeline_root, stage_owners, stage_parts)
from lightning_autopar.parallel.pipeline.runtime import Pipeline, StagedPipeline
from lightning_autopar.parallel.pipeline.standins import StageBlocks, ZeroEmbedding, ZeroOutputs, stand_in_module
from lightning_autopar.parallel.pipeline.trace import (SplitRefusals, TracedSplit, UnitOrderError, check_traced_pipeline,
                                                       flatten_inputs, split_refusals, trace_split)
from lightning_autopar.parallel.pipeline.traced import TracedChunk, TracedPipeline

__all__ = [
    "MoESource", "Pipeline", "PipelineChunk", "SplitRefusals", "StageBlocks", "StageParts", "StagedPipeline", "TracedChunk", "TracedPipeline",
    "TracedSplit", "UnitOrderError", "ZeroEmbedding", "ZeroOutputs", "capture_model_call", "check_pipeline", "check_schedule", "check_traced_pipeline",
    "chunk_sizes", "flatten_inputs", "model_call_replaced", "moe_sources", "pipeline_root", "router_recorder",
    "split_model", "split_refusals", "stage_owners", "stage_parts", "stand_in_module", "trace_split",
]
