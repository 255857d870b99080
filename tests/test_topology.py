"""LPLB topologies: the published r2o tables, and clear errors for bad custom ones."""

from __future__ import annotations

import pytest
import torch

from portapipe.balancing.topology import by_name, cube, hypercube, ring, torus, validate_r2o


def test_cube_is_the_published_table() -> None:
    expected = torch.tensor([[3, 0, 1, 2, 7, 4, 5, 6], [6, 7, 4, 5, 0, 1, 2, 3]]).T
    assert torch.equal(cube(), expected)
    assert cube().dtype == torch.int64


def test_hypercube_columns() -> None:
    h = hypercube()
    assert h.shape == (16, 2)
    assert h[:, 0].tolist() == [3, 0, 1, 2, 7, 4, 5, 6, 11, 8, 9, 10, 15, 12, 13, 14]
    assert h[:, 1].tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_ring_and_torus() -> None:
    assert ring(8)[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    t = torus(8, 4)
    assert t.shape == (32, 2)
    for i in range(8):
        for j in range(4):
            assert t[i * 4 + j].tolist() == [((i + 1) % 8) * 4 + j, i * 4 + (j + 1) % 4]
    assert torus(4, 8).shape == (32, 2)


@pytest.mark.parametrize("r2o", [cube(), hypercube(), ring(8), ring(3), torus(8, 4), torus(4, 8), torus(2, 2)])
def test_builtins_validate(r2o: torch.Tensor) -> None:
    assert torch.equal(validate_r2o(r2o, ep_size=r2o.shape[0] * 2), r2o)


@pytest.mark.parametrize(
    "r2o, ep, error, match",
    [
        (cube().float(), None, TypeError, "integer dtype"),
        ([[1], [0]], None, TypeError, "torch.Tensor"),
        (torch.tensor([1, 0]), None, ValueError, r"shape \[group_size >= 2, classes >= 1\]"),
        (torch.tensor([[1], [2]]), None, ValueError, r"r2o\[1, 0\] = 2 is not a rank of the group"),
        (torch.tensor([[-1], [0]]), None, ValueError, r"r2o\[0, 0\] = -1"),
        (torch.tensor([[1], [0], [0]]), None, ValueError, r"column 0 must be a permutation .* ranks \[0\] are copied more than once and ranks \[2\] never"),
        (torch.tensor([[0], [1]]), None, ValueError, "copy of its own class-0 experts"),
        (cube(), 12, ValueError, "group size 8 must divide the EP size 12"),
    ],
)
def test_bad_r2o_names_the_problem(r2o: object, ep: int | None, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        validate_r2o(r2o, ep)  # type: ignore[arg-type]


def test_bad_builder_arguments() -> None:
    with pytest.raises(ValueError, match="n must be an int >= 2"):
        ring(1)
    with pytest.raises(ValueError, match="m and n must be ints >= 2"):
        torus(4, 1)


def test_by_name() -> None:
    assert torch.equal(by_name("cube"), cube())
    assert torch.equal(by_name("ring", ring_size=4), ring(4))
    assert torch.equal(by_name("torus", torus_shape=(4, 8)), torus(4, 8))
    with pytest.raises(ValueError, match=r"needs its shape: torus: \[m, n\]"):
        by_name("torus")
    with pytest.raises(ValueError, match="unknown LPLB topology 'star'"):
        by_name("star")
