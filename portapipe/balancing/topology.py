"""LPLB replica topologies: which rank holds a copy of which rank's replicated experts.

A topology is an ``r2o`` tensor of shape ``[g, d]`` (int64) for a group of ``g`` ranks with
``d`` redundant-slot classes per rank: rank ``i``'s class-``k`` redundant slots hold copies of
rank ``r2o[i, k]``'s class-``k`` original experts. Every column is a permutation without fixed
points, so each replicated expert lives on exactly two ranks (its original and one copy) and
every rank has the same number of copies. An EP group of ``ep`` ranks is split into ``ep // g``
consecutive groups that each use the same ``r2o``.
"""

from __future__ import annotations

import torch

__all__ = ["cube", "hypercube", "ring", "torus", "by_name", "validate_r2o", "TOPOLOGIES"]


def cube() -> torch.Tensor:
    """8 ranks, 2 classes: class 0 copies i-1 within each half of 4 ranks, class 1 a rank of the other half."""
    return torch.tensor([[3, 0, 1, 2, 7, 4, 5, 6], [6, 7, 4, 5, 0, 1, 2, 3]], dtype=torch.int64).T.contiguous()


def hypercube() -> torch.Tensor:
    """16 ranks, 2 classes: class 0 copies i-1 within blocks of 4, class 1 copies i-4 mod 16."""
    i = torch.arange(16, dtype=torch.int64)
    return torch.stack([(i // 4) * 4 + (i - 1) % 4, (i - 4) % 16], dim=1)


def ring(n: int = 8) -> torch.Tensor:
    """``n`` ranks, 1 class: rank i copies rank i+1 (mod n)."""
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"ring(n): n must be an int >= 2 (a ring of {n!r} ranks has no neighbour to copy)")
    return ((torch.arange(n, dtype=torch.int64) + 1) % n).unsqueeze(1)


def torus(m: int, n: int) -> torch.Tensor:
    """``m * n`` ranks on an m x n torus, 2 classes: rank i*n+j copies ((i+1)%m)*n+j and i*n+(j+1)%n."""
    if not (isinstance(m, int) and isinstance(n, int)) or m < 2 or n < 2:
        raise ValueError(f"torus(m, n): m and n must be ints >= 2, got m={m!r}, n={n!r}")
    i = torch.arange(m, dtype=torch.int64).repeat_interleave(n)
    j = torch.arange(n, dtype=torch.int64).repeat(m)
    return torch.stack([((i + 1) % m) * n + j, i * n + (j + 1) % n], dim=1)


#: name -> builder, for configs (``balancer.topology``)
TOPOLOGIES = {"cube": cube, "hypercube": hypercube, "ring": ring, "torus": torus}


def by_name(name: str, *, ring_size: int = 8, torus_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """The topology a config names (``balancer.topology``; ``balancer.torus`` gives torus_shape)."""
    if name == "cube":
        return cube()
    if name == "hypercube":
        return hypercube()
    if name == "ring":
        return ring(ring_size)
    if name == "torus":
        if torus_shape is None:
            raise ValueError("topology torus needs its shape: torus: [m, n]")
        return torus(*torus_shape)
    raise ValueError(f"unknown LPLB topology {name!r}; known: {', '.join(TOPOLOGIES)}")


def validate_r2o(r2o: torch.Tensor, ep_size: int | None = None) -> torch.Tensor:
    """Check a topology and return it as a contiguous int64 CPU tensor.

    Raises ValueError / TypeError naming what is wrong: not a 2-d integer tensor, ranks out of
    range, a class whose copies are not shared by exactly two ranks (a column that is not a
    permutation, or a rank copying itself), or a group size that does not divide ``ep_size``.
    """
    if not isinstance(r2o, torch.Tensor):
        raise TypeError(f"r2o must be a torch.Tensor of shape [group_size, classes], got {type(r2o).__name__}")
    if r2o.dtype.is_floating_point or r2o.dtype.is_complex or r2o.dtype == torch.bool:
        raise TypeError(f"r2o must have an integer dtype (int32 or int64), got {r2o.dtype}")
    if r2o.dim() != 2 or r2o.shape[0] < 2 or r2o.shape[1] < 1:
        raise ValueError(
            f"r2o must have shape [group_size >= 2, classes >= 1] (e.g. cube() is [8, 2]), got {list(r2o.shape)}"
        )
    t = r2o.detach().to("cpu", torch.int64).contiguous()
    g, d = t.shape
    bad = (t < 0) | (t >= g)
    if bool(bad.any()):
        i, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"r2o[{i}, {k}] = {int(t[i, k])} is not a rank of the group: values must be in [0, {g})")
    ranks = torch.arange(g)
    for k in range(d):
        col = t[:, k]
        self_copy = (col == ranks).nonzero()
        if len(self_copy):
            i = int(self_copy[0])
            raise ValueError(
                f"r2o[{i}, {k}] = {i}: rank {i} would hold a copy of its own class-{k} experts; "
                "each redundant expert must be shared by two different ranks"
            )
        counts = torch.bincount(col, minlength=g)
        if bool((counts != 1).any()):
            twice = (counts > 1).nonzero().flatten().tolist()
            never = (counts == 0).nonzero().flatten().tolist()
            raise ValueError(
                f"r2o column {k} must be a permutation of 0..{g - 1} so that every class-{k} original has "
                f"exactly one copy: ranks {twice} are copied more than once and ranks {never} never"
            )
    if ep_size is not None and ep_size % g != 0:
        raise ValueError(f"the r2o group size {g} must divide the EP size {ep_size}")
    return t
