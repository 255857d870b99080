"""The conformance kit moved to :mod:`portapipe.testing` (beside the launcher it starts ranks
with: the backends import nothing above themselves). This name only says so:

    PORTAPIPE_CONFORMANCE_BACKEND=<name> pytest --pyargs portapipe.testing
"""

from __future__ import annotations

from typing import NoReturn

MOVED = (
    "the conformance kit moved from portapipe.backends.testing to portapipe.testing: "
    "run PORTAPIPE_CONFORMANCE_BACKEND=<name> pytest --pyargs portapipe.testing, "
    "and import its functions from portapipe.testing"
)


#: what the kit offered under the old name: asking for one of them says where it went (any
#: other name is a plain AttributeError, as pytest's and the import system's probes expect)
_OLD_NAMES = frozenset(
    "ENV OPTIONS_ENV GROUPED_MM_TOLERANCE LOCAL RANK_LINES Contract ContractFailure run_local rank_contracts "
    "run_ranks_contracts".split()
)


def __getattr__(name: str) -> NoReturn:
    if name in _OLD_NAMES:
        raise ImportError(f"portapipe.backends.testing.{name}: {MOVED}")
    raise AttributeError(f"module 'portapipe.backends.testing' has no attribute {name!r}")
