"""The conformance kit as a pytest module: one test per contract line.

    PORTAPIPE_CONFORMANCE_BACKEND=<name> pytest --pyargs portapipe.testing

``<name>`` is a backend name as a config gives it (a plug-in's entry-point name);
``PORTAPIPE_CONFORMANCE_OPTIONS`` may hold its ``backend_options`` as JSON. Default: cpu.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from portapipe.backends import get_backend
from portapipe.testing import ENV, LOCAL, OPTIONS_ENV, RANK_LINES, run_local, run_ranks_contracts

NAME = os.environ.get(ENV, "cpu")
OPTIONS: dict[str, Any] = json.loads(os.environ.get(OPTIONS_ENV, "{}"))


@pytest.fixture(scope="module")
def backend() -> Any:
    return get_backend(NAME, OPTIONS)


@pytest.fixture(scope="module")
def on_ranks() -> dict[str, str | None]:
    return run_ranks_contracts(NAME, OPTIONS)


@pytest.mark.parametrize("line", [c.line for c in LOCAL])
def test_local(backend: Any, line: str) -> None:
    failure = run_local(backend, lines=tuple(c for c in LOCAL if c.line == line))[line]
    assert failure is None, failure


@pytest.mark.parametrize("line", [line for line, *_ in RANK_LINES])
def test_on_two_ranks(on_ranks: dict[str, str | None], line: str) -> None:
    assert on_ranks[line] is None, on_ranks[line]
