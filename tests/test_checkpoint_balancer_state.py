"""The balancer's part of a checkpoint, through DCP and back, in one process.

Besides the placement and the recorded loads, a checkpoint keeps whether the placement came
from loads: an incremental policy changes a planned placement but plans a first one from
scratch, so a resumed run that forgot it would plan its next placement differently from an
uninterrupted run.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from portapipe.checkpoint.files import load_no_dist, read_dcp_metadata
from portapipe.checkpoint.state import balancer_state, balancer_targets, restore_balancer


class FakeBalancer:
    """What the checkpoint code reads of a balancer: layers, the placement's replica counts, its state."""

    def __init__(self, layers: list[int], phy2log: torch.Tensor, log2phy: torch.Tensor, loads: torch.Tensor, planned: bool) -> None:
        self.layers = layers
        logcnt = (log2phy >= 0).sum(-1)
        self.placement = SimpleNamespace(logcnt=logcnt)
        self.state = {"kind": "eplb", "phy2log": phy2log, "log2phy": log2phy, "loads": {"steps": loads}, "planned": planned}
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**self.state, "loads": dict(self.state["loads"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _balancer(planned: bool, seed: int) -> FakeBalancer:
    g = torch.Generator().manual_seed(seed)
    phy2log = torch.stack([torch.randperm(4, generator=g) for _ in range(2)])
    log2phy = torch.stack([row.argsort()[:, None] for row in phy2log])
    return FakeBalancer([1, 3], phy2log, log2phy, torch.rand(5, 2, 4, generator=g), planned)


def _round_trip(saved: FakeBalancer, fresh: FakeBalancer, path: Path, placement_fits: bool) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"balancer": balancer_state(saved)}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    loaded = balancer_targets(fresh, read_dcp_metadata(path))
    load_no_dist(path, loaded)
    restore_balancer(fresh, loaded, placement_fits)
    assert fresh.loaded is not None
    return fresh.loaded


@pytest.mark.parametrize("planned", [True, False])
def test_the_placement_its_origin_and_the_loads_survive_a_checkpoint(tmp_path: Path, planned: bool) -> None:
    saved = _balancer(planned, seed=1)
    got = _round_trip(saved, _balancer(not planned, seed=2), tmp_path / "ckpt", placement_fits=True)
    assert got["planned"] is planned
    assert torch.equal(got["phy2log"], saved.state["phy2log"])
    assert torch.equal(got["log2phy"], saved.state["log2phy"])
    assert torch.equal(got["loads"]["steps"], saved.state["loads"]["steps"])


def test_a_placement_that_does_not_fit_keeps_the_fresh_one_and_its_origin(tmp_path: Path) -> None:
    fresh = _balancer(False, seed=2)
    got = _round_trip(_balancer(True, seed=1), fresh, tmp_path / "ckpt", placement_fits=False)
    assert got["planned"] is False
    assert torch.equal(got["phy2log"], fresh.state["phy2log"])
