"""What ``pytest --pyargs portapipe.backends.testing`` (the kit's old name) collects: one test
that fails naming the new one (see the package's docstring)."""

from __future__ import annotations

import pytest

from . import MOVED


def test_the_kit_moved() -> None:
    pytest.fail(MOVED, pytrace=False)
