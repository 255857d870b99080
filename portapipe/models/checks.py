"""What stops a config's model from running as asked, found before any rank starts.

``portapipe train`` and ``portapipe verify`` refuse a config on the same lines (with the
schedule's own check, :func:`portapipe.scheduling.executor.build_schedule`): a check added here
holds for both, so verify never says ok for a model that training refuses.
"""

from __future__ import annotations

from ..config import Config


def model_problems(config: Config) -> list[str]:
    """One line per problem (empty when none): the weights to start from (``model.init_from``),
    ``train.fp8`` on a model none of whose Linears can run in FP8, a benchmark's routing file
    (``bench.router_skew_from``) that does not fit the model."""
    from .fp8_layers import fp8_problems
    from .hf_io import init_problems
    from .routing import skew_table

    problems = init_problems(config.model) + fp8_problems(config.model, config.train.fp8)
    try:
        skew_table(config.bench, config.model)
    except ValueError as err:
        problems.append(str(err))
    return problems
