"""What a run reports: the metrics file and its sinks, and each step's figures over the ranks.

- :mod:`.log`: ``<log.dir>/metrics.jsonl`` (one JSON line per record, rank 0), cut back on a resume;
- :mod:`.step`: a step's figures gathered over the ranks, the run's medians, the memory record;
- :mod:`.tensorboard_sink`, :mod:`.wandb_sink`: the same lines as TensorBoard scalars / a W&B run.
"""
