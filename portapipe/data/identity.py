"""What a checkpoint records of the data, and whether a resumed run reads the same.

A step's batch is a pure function of (seed, sources, global batch, step), so the data position
needs nothing restored but the step; what can change under a resume is the sources. The record
names each training source (path, kind, tokens, documents, weight, the part trained on) with a
*fingerprint* of its files: their sizes and a digest of 17 blocks of 64 KiB at fixed places
(start, end and 15 between), read in milliseconds whatever the size, so a moved or copied
dataset still matches and a rewritten one does not (a rewrite that keeps every size and every
sampled block is not seen). :func:`changes` says in one line what differs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .corpus import Corpus

_BLOCK = 1 << 16
_PLACES = 17


def fingerprint(files: tuple[Path, ...]) -> str:
    """A digest of the files' sizes and of blocks at fixed places in each."""
    h = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}:".encode())
        with open(file, "rb") as f:
            for i in range(_PLACES):
                f.seek(max(0, (size - _BLOCK) * i // (_PLACES - 1)))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def record(corpus: Corpus) -> dict[str, Any]:
    """The data's identity as a checkpoint keeps it (weights normalised: only their ratio matters)."""
    total = sum(p.weight for p in corpus.train)
    return {
        "sampling": corpus.sampling,
        "sources": [
            {"path": str(p.source.path), "kind": p.source.kind, "tokens": len(p.source.tokens), "documents": p.source.documents,
             "weight": p.weight / total, "part": [p.lo, p.hi], "fingerprint": fingerprint(p.source.files)}
            for p in corpus.train
        ],
    }


def changes(then: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """How the sources ``now`` differ from those a checkpoint recorded (``then``), in words;
    None when they are the same (a record without sources, from before they were recorded, too)."""
    if not then or "sources" not in then:
        return None
    if then.get("sampling") != now["sampling"]:
        return f"data.sampling: the checkpoint's data was sampled as {then.get('sampling')}, this run's as {now['sampling']}"
    a, b = then["sources"], now["sources"]
    if len(a) != len(b):
        return f"data.sources: the checkpoint was trained on {len(a)} source(s) ({_paths(a)}), this run has {len(b)} ({_paths(b)})"
    for i, (x, y) in enumerate(zip(a, b)):
        if x["fingerprint"] != y["fingerprint"]:
            return f"data.sources[{i}]: {y['path']} is not the data the checkpoint was trained on ({x['path']}, {x['tokens']} tokens; its files differ)"
        if abs(x["weight"] - y["weight"]) > 1e-12:
            return f"data.sources[{i}].weight: its share is {y['weight']:.6g}, the checkpoint was trained with {x['weight']:.6g}"
        if list(x["part"]) != list(y["part"]):
            return f"data.val_fraction: source {i} ({y['path']}) trains on tokens {y['part'][0]}..{y['part'][1]}, the checkpoint on {x['part'][0]}..{x['part'][1]}"
    return None


def _paths(sources: list[dict[str, Any]]) -> str:
    return ", ".join(s["path"] for s in sources)
