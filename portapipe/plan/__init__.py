"""Planning: which schedule, layout, micro-batch count and memory option fit a memory budget.

- the compatibility rules and :class:`~portapipe.config.setup.Setup` sit beside the config they
  validate (:mod:`portapipe.config.rules`, :mod:`portapipe.config.setup`); the planner reads them;
- :mod:`.shape`: what the model holds and computes per part (parameters, FLOPs, saved bytes);
  :mod:`.fp8_bytes`: what ``train.fp8`` and ``memory.fp8_activations`` change in the saved bytes;
- :mod:`.profile`: measured (``portapipe profile``) or published per-part costs of a device;
- :mod:`.programs`: a stage's forward and backward as the executor runs them, part by part;
- :mod:`.memory_model` / :mod:`.time_model`: per-rank peak memory and step time of one setup;
- :mod:`.planner`: enumerate setups, drop what breaks a rule or the budget, rank the rest.

See docs/plan.md.
"""
