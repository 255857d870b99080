"""Part d: 20 steps on CPU continued on CUDA to 40 (and back) against 40 straight on CPU; bf16
with float32 master against float32, validation loss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from .common import Ctx, Record, cli, cuda_options, cuda_reason, say, set_args, starter, tail


def losses(metrics_path: str) -> dict[int, float]:
    """step -> loss of a run's metrics.jsonl (the steps' records)."""
    out: dict[int, float] = {}
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "train" and r.get("loss") is not None:
            out[int(r["step"])] = float(r["loss"])
    return out


def part_portability(rec: Record, ctx: Ctx) -> None:
    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    half, steps, val_steps = (2, 4, 4) if ctx.dry else (20, 40, 300)
    tiny = {"parallel.pp": 1, "parallel.ep": 1, "model.hidden": 16, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 32,
            "model.moe_hidden": 16, "model.n_experts": 4, "model.seq_len": 16, "train.micro_batch_size": 2}
    cfg = str(starter("cpu"))
    common = {**(tiny if ctx.dry else {}), "log.progress": "false", "checkpoint.every": half}

    def train(name: str, legs: list[tuple[str, int]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        folder = ctx.work / name
        shutil.rmtree(folder, ignore_errors=True)
        out: dict[str, Any] = {"legs": []}
        for backend, upto in legs:
            ranks = 1 if ctx.dry else 4
            opts = {f"backend_options.{k}": v for k, v in (cuda_options(ranks) if backend == "cuda" else {}).items()}
            res = cli(["train", cfg, "--steps", str(upto), *set_args({**common, **(extra or {}), "backend": backend, "log.dir": folder, **opts})], ctx.left())
            out["legs"].append({"backend": backend, "to_step": upto, "rc": res["rc"], "s": res["s"]})
            if res["rc"] != 0 or "json" not in res:
                out["error"] = tail(res["stderr"], 6)
                return out
            out["summary"] = res["json"]
        out["losses"] = losses(out["summary"]["metrics"])
        return out

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-30)

    straight = train("cpu_straight", [("cpu", steps)])
    rec.put("cpu_straight", straight)
    rows = {}
    trips = {"cpu_then_" + device: [("cpu", half), (device, steps)], device + "_then_cpu": [(device, half), ("cpu", steps)]}
    for name, legs in trips.items():  # on the CPU alone the two trips are one: a resumed run
        say(f"  d: {name}")
        run = train(name, legs)
        if "losses" in run and "losses" in straight:
            common_steps = sorted(set(run["losses"]) & set(straight["losses"]))
            run["steps_compared"] = len(common_steps)
            run["max_rel_loss_diff"] = max((rel(run["losses"][s], straight["losses"][s]) for s in common_steps), default=None)
        rows[name] = run
        rec.put(name, run)
    say(f"  d: bfloat16 against float32, {val_steps} steps on {device}")
    vals = {}
    for dtype in ("float32", "bfloat16"):
        if ctx.dry and dtype == "float32":  # the straight run is this one (tiny, one rank, float32)
            vals[dtype] = straight.get("summary", {}).get("val_loss")
            continue
        run = train(f"{device}_{dtype}", [(device, val_steps)], {"model.dtype": dtype, "parallel.pp": 1, "parallel.ep": 1, "checkpoint.every": 0})
        vals[dtype] = run.get("summary", {}).get("val_loss")
        rec.put(f"val_{dtype}", {k: v for k, v in run.items() if k != "losses"})
    gap = rel(vals["bfloat16"], vals["float32"]) if None not in vals.values() else None
    rec.put("bf16_val_loss_rel_gap", gap)
    diffs = [r.get("max_rel_loss_diff") for r in rows.values()]
    tol = 1e-3  # float32 steps of a different device, compounded over the continued steps
    rec.put("tolerance", {"continuation_max_rel_loss_diff": tol, "bf16_val_loss_rel_gap": 0.005})
    good = None not in diffs and all(d <= tol for d in diffs) and gap is not None and (ctx.dry or gap <= 0.005)
    if device == "cpu":
        good = good and all(d == 0.0 for d in diffs)  # the same device: a resumed run is the straight one, bit for bit
    rec["summary"] = (", ".join(f"{n}: max rel loss diff {d:.2e}" if d is not None else f"{n}: failed" for n, d in zip(rows, diffs))
                      + (f"; bf16 val loss {100 * gap:.2f}% off float32" if gap is not None else "; bf16: failed"))
    rec["status"] = ("ok" if good else "failed") if device == "cuda" else ("failed" if not good else "dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"

