"""LPLB's mapping rule: in token order, the first ``count - moved`` entries of a replicated
expert stay on its original and the rest go to its copy. :func:`occurrence_rank` states the
rule; :func:`map_sorted` is the torch path's mapping by it (the C and Triton paths compute the
same thing their own way)."""

from __future__ import annotations

import torch


def occurrence_rank(flat: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """For each entry of ``flat`` (values in [-1, E)), how many earlier entries have its value.

    ``counts`` is ``bincount(flat + 1)`` (the -1 bin first). This is the rule the mapping
    follows (an entry of expert e stays on the original iff its occurrence rank is below e's
    kept count); the torch path and the Triton kernels compute the same thing their own way.
    """
    order = torch.sort(flat, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    ranks_sorted = torch.arange(flat.numel(), device=flat.device) - starts[flat[order] + 1]
    out = torch.empty_like(ranks_sorted)
    out[order] = ranks_sorted
    return out


def map_sorted(flat: torch.Tensor, binned: torch.Tensor, moved: torch.Tensor, segments: torch.Tensor, n_logical: int) -> torch.Tensor:
    """The torch path of the mapping: in stably sorted order the entries of expert e are
    contiguous, its first ``count - moved`` go to the original and the rest to the copy, so the
    sorted output is one repeat_interleave of ``segments`` (the -1 bin's value, then each
    expert's original and copy slot); a scatter puts it back in token order."""
    keys = flat.to(torch.int16) if n_logical < 2**15 - 1 else flat  # smaller keys sort faster
    order = torch.sort(keys, stable=True).indices
    repeats = torch.cat([binned[:1], torch.stack([binned[1:] - moved, moved], 1).reshape(-1)])
    out_sorted = torch.repeat_interleave(segments, repeats, output_size=flat.numel())
    return torch.empty_like(out_sorted).scatter_(0, order, out_sorted)
