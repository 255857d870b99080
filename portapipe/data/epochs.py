"""Epochs without replacement over a source's samples, each in its own seeded order.

A source's split of ``n`` tokens holds ``(n - 1) // seq_len`` samples: windows of ``seq_len + 1``
tokens laid end to end (window i covers tokens ``i * seq_len .. i * seq_len + seq_len``, so the
last token of one is the first of the next, as Megatron lays them), packed across document
boundaries. Its k-th sample overall is sample ``k mod n`` of epoch ``k // n``, and epoch e visits
the windows in the order :func:`permute` gives for ``(seed, source, e)``: within an epoch no
window repeats, and each epoch has an order of its own.

The permutation is computed per index, never stored: a four-round Feistel network over the
smallest even power of two holding ``n``, keyed by a hash of (seed, source, epoch), with cycle
walking to stay inside ``0 .. n - 1``. It is a bijection for every key, so memory and start-up
time do not grow with the corpus, and any sample of any epoch is found in a few operations.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def seed_of(*parts: object) -> int:
    """A 64-bit key from the parts; stable across processes, machines and Python versions."""
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective scrambling of 64-bit words (arrays wrap silently)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=256)
def _round_keys(key: int) -> list[np.uint64]:
    return [np.uint64(seed_of(key, r)) for r in range(_ROUNDS)]


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """Where each of ``index`` (in ``0 .. n - 1``) goes in the permutation of ``0 .. n - 1`` keyed by ``key``."""
    index = np.asarray(index, dtype=np.int64)
    if n <= 0:
        raise ValueError(f"no permutation of {n} items")
    if index.size and (index.min() < 0 or index.max() >= n):
        raise ValueError(f"an index outside 0..{n - 1}")
    if n == 1:
        return np.zeros_like(index)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = _round_keys(key)

    def rounds(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    x = rounds(index.astype(np.uint64))
    outside = x >= np.uint64(n)
    while outside.any():  # cycle walking: apply again until inside (at most a few times: 4n > the domain)
        x[outside] = rounds(x[outside])
        outside = x >= np.uint64(n)
    return x.astype(np.int64)


def samples_in(tokens: int, seq_len: int) -> int:
    """How many windows of ``seq_len + 1`` tokens, laid end to end, ``tokens`` hold."""
    return max(0, (tokens - 1) // seq_len)


def window_starts(k: np.ndarray, n_samples: int, seq_len: int, seed: int, source: int) -> np.ndarray:
    """The first token (within its split) of each of a source's ``k``-th samples overall."""
    k = np.asarray(k, dtype=np.int64)
    epoch, i = np.divmod(k, n_samples)
    out = np.empty_like(k)
    for e in np.unique(epoch):
        at = epoch == e
        out[at] = permute(i[at], n_samples, _epoch_key(seed, source, int(e))) * seq_len
    return out


@functools.lru_cache(maxsize=256)
def _epoch_key(seed: int, source: object, epoch: int) -> int:
    return seed_of(seed, "epoch", source, epoch)
