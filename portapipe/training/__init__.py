"""One rank's training loop and the parts it is made of.

:class:`.loop.Trainer` runs the steps; each concern it calls is a small object of its own:

- :mod:`.update`: the learning rate of a step, clipping, AdamW over master weights (and the EMA);
- :mod:`.decide`: whether a step's update is applied, skipped (float16's overflow) or ends the
  run (a loss or gradient norm that is not finite);
- :mod:`.checkpoints`: when the loop checkpoints (every N steps, on a stop, at the end) and that
  no checkpoint holds weights that are not finite;
- :mod:`.record`: the metrics rows of a step (train, overflow, diverged, memory) and the progress bar;
- :mod:`.hooks`: work that runs with each step (the expert loads file, a recorded timeline);
- :mod:`.validation`: the validation loss at the end;
- :mod:`.summary`: the run's progress as checkpoints carry it, and the summary it ends with.
"""
