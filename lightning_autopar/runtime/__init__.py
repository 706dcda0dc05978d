"""Step execution, shared by the Trainer strategy, the Fabric strategy and trial runs.

* ``batches``: a DataLoader batch (the global batch of one step) cut into dp slices and micro-batches.
* ``logs``: the recorder standing in for ``self.log`` during the micro-batch loop.
* ``grads``: gradients held between micro-batches until the framework's backward.
* ``group``: the data-parallel group a step reduces over; the start from rank 0's weights.
* ``step``: the data-parallel micro-batch training step and the evaluation step.
* ``pipeline_step``: the pipeline-parallel training and evaluation steps (an object per step, not a tuple).
* ``analysis``: what the plan applies to (the transformer, or the user's model call in unit form).
* ``planning``: plan and apply, the part of the strategies both frameworks share.
* ``trial``: plan P run for a few steps on the live group, measured, leaving no state behind.
* ``lightning_private``: every touch of Lightning's private API, with the version it was checked against.

"""
