"""Part c: `verify` on the GPU for every schedule, 4 ranks sharing it and one rank; EPLB, LPLB,
zero-memory level1, recompute moe and ZeRO 2 once each: float32 on the device against float64 on
the CPU."""

from __future__ import annotations

import json
import traceback
from typing import Any

from .common import Ctx, Record, cuda_options, cuda_reason, say, starter, tail

SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")


def verify_configs(device: str, dry: bool) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """(label, raw config) per launch: the schedules at 4 ranks, the options at 4 ranks, one rank."""
    import yaml

    base = yaml.safe_load(starter("cpu").read_text())
    base.update(backend=device, backend_options=cuda_options(4) if device == "cuda" else {})
    if dry:  # tiny: two layers of width 16
        base["model"].update(hidden=16, n_layers=2, n_heads=2, ffn_hidden=32, moe_hidden=16, n_experts=4, seq_len=8)
        base["train"]["micro_batch_size"] = 2

    def cfg(name: str, pp: int, ep: int, **sections: dict[str, Any]) -> dict[str, Any]:
        raw = json.loads(json.dumps(base))
        raw["parallel"].update(pp=pp, ep=ep, dp=1)
        raw["schedule"].update(name=name, microbatches=4 if pp > 1 or name in ("dualpipe", "dualpipev") else 2)
        if pp * ep == 1:
            raw["backend_options"] = {}
        for section, values in sections.items():
            raw.setdefault(section, {}).update(values)
        return raw

    options = {
        "eplb": {"balancer": {"kind": "eplb", "redundant": 1}},
        "lplb": {"balancer": {"kind": "lplb", "topology": "ring", "redundant": 1}},
        "zero_memory_level1": {"memory": {"zero_memory": "level1"}},
        "recompute_moe": {"memory": {"recompute": "moe"}},
        "zero_stage_2": {"train": {"zero_stage": 2}},
    }
    if dry:  # one launch of one rank: the code path, at the least cost (DualPipe at pp 1 is refused before it)
        return {"one_rank": [(f"{name} x1", cfg(name, 1, 1)) for name in ("1f1b", "dualpipev", "dualpipe")]}
    return {
        "four_ranks": [(f"{name} pp2 x ep2", cfg(name, 2, 2)) for name in SCHEDULES],
        "options": [(f"dualpipev pp2 x ep2 + {label}", cfg("dualpipev", 2, 2, **secs)) for label, secs in options.items()],
        "one_rank": [(f"{name} x1", cfg(name, 1, 1)) for name in SCHEDULES],  # a schedule the rules refuse at one rank is named so
    }


def part_verify(rec: Record, ctx: Ctx) -> None:
    from portapipe.config import load_config
    from portapipe.verify import verify_many

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    rec.put("device", device)
    if device == "cpu":  # the GPU run's configs pass the rules here too (on the cpu backend), or say why not
        planned = {}
        for launch, labelled in verify_configs("cpu", False).items():
            for label, raw in labelled:
                try:
                    load_config(raw)
                    planned[label] = "accepted"
                except Exception as exc:
                    planned[label] = "refused: " + " ".join(str(exc).split())[:200]
        rec.put("gpu_configs", planned)
    ok = total = 0
    for launch, labelled in verify_configs(device, ctx.dry or reason is not None).items():
        runnable, refused = [], []
        for label, raw in labelled:
            try:  # the checks `portapipe verify` makes before any rank starts (the rules among them)
                runnable.append((label, load_config(raw)))
            except Exception as exc:
                refused.append({"config": label, "not_applicable": " ".join(str(exc).split())[:300]})
        say(f"  c: {launch}: {len(runnable)} configs ({len(refused)} refused by the rules)")
        try:
            reports = verify_many([c for _, c in runnable], wall_timeout_s=ctx.left())
            rows = [{"config": label, **r.summary()} for (label, _), r in zip(runnable, reports)]
        except Exception as exc:
            rows = [{"config": label, "ok": False, "error": tail("".join(traceback.format_exception_only(type(exc), exc)), 4)} for label, _ in runnable]
        ok += sum(bool(r["ok"]) for r in rows)
        total += len(rows)
        rec.put(launch, rows + refused)
    precisions = {r.get("precision") for rows in rec["results"].values() if isinstance(rows, list) for r in rows if r.get("precision")}
    rec["summary"] = f"{ok}/{total} ok on {device}, {'/'.join(sorted(precisions))} against float64 on the CPU"
    done = "ok" if ok == total else "failed"
    if device == "cpu":
        rec["reason"] = reason or "dry mode"
        done = "failed" if ok < total else ("dry" if ctx.dry else "skipped")
    rec["status"] = done

