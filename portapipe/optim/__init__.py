"""What happens between a step's backward and the next forward: mixed precision and the optimizer.

- :mod:`.precision`: which dtype does what (``model.dtype`` computes, ``train.master_dtype``
  keeps master weights, gradient accumulation and AdamW's state), float16's loss scaling;
- :mod:`.buckets`: gradients accumulated in per-block flat buckets and reduced over the
  replicas at the executor's seam, while the schedule still runs;
- :mod:`.adamw`: AdamW on flat tensors;
- :mod:`.sharded`: master weights and AdamW state over the buckets, whole or sharded over the
  data-parallel replicas (``train.zero_stage``).
"""
