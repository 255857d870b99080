"""Seeing what a run does: every rank's spans of chosen steps on one clock, beside the plan.

- :mod:`.record`: one rank's spans of one step (what :mod:`portapipe.scheduling.spans` emits),
  timed by the backend's span clock, read once after the step;
- :mod:`.align`: each rank's clock offset against rank 0 from round trips, and its bound;
- :mod:`.trace`: the step's files, Chrome trace-event JSON and plain rows, every rank merged;
- :mod:`.hook`: ``log.timeline``, the loop's hook that records chosen steps;
- :mod:`.profiler`: ``log.profiler``, chosen steps under torch.profiler with the same names;
- :mod:`.analyze`: time by kind per rank, and the checks that a record is right;
- :mod:`.plan`: the simulator's plan of the recorded step, and how far the step strayed from it;
- :mod:`.draw`: the picture ``portapipe timeline`` draws.
"""
