"""Part i: the step-time claims, step_vs_torch and balance_e2e, with the machine's cores shared out
one set per rank."""

from __future__ import annotations

import os
import sys

from .common import CHECKOUT, Ctx, Record, last_json, run_cmd, say, tail


def part_step_claims(rec: Record, ctx: Ctx) -> None:
    if CHECKOUT is None:
        rec.update(status="skipped", summary="needs a source checkout (balance_e2e reads examples/expert_loads.txt)")
        return
    from portapipe.train import rank_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rec.put("cores", {"usable": cores, "threads_per_rank_4": rank_threads(4), "threads_per_rank_8": rank_threads(8),
                      "pinning": "none: the launcher has no per-rank core option; each rank runs rank_threads() = cores // ranks "
                                 "intra-op threads, so ranks x threads <= cores; the operating system places them"})
    bench = CHECKOUT / "benchmarks"
    runs = {
        "step_vs_torch": [sys.executable, str(bench / "step_vs_torch.py"), "--steps", "8", "--warmup", "2"],
        "balance_e2e": [sys.executable, str(bench / "balance_e2e.py"), "--layouts", "ep4", "pp2ep4", "--sources", "loads", "uniform",
                        "--steps", "6", "--warmup", "2"],
    }
    if ctx.dry or cores < 8:  # the flags still have to be the benchmarks' own: --help lists them
        for name, cmd in runs.items():
            res = run_cmd([cmd[0], cmd[1], "--help"], ctx.left())
            flags = [c for c in cmd[2:] if c.startswith("--")]
            missing = [f for f in flags if f not in res["stdout"]]
            rec.put(name, {"command": " ".join(cmd[1:]), "help_rc": res["rc"], "flags_missing": missing})
            if res["rc"] != 0 or missing:
                rec.update(status="failed", summary=f"{name}: {missing or tail(res['stderr'], 3)}")
                return
        rec.update(status="dry" if ctx.dry else "skipped", reason="dry mode" if ctx.dry else f"{cores} cores: the claims need one core set per rank (8 or more)",
                   summary="commands checked against the benchmarks' --help")
        return
    bad = 0
    for name, cmd in runs.items():
        say(f"  i: {name}")
        res = run_cmd(cmd, ctx.left() * (0.55 if name == "step_vs_torch" else 1.0), cwd=CHECKOUT)
        try:
            rec.put(name, {"command": " ".join(cmd[1:]), "s": res["s"], "result": last_json(res["stdout"])})
        except ValueError:
            bad += 1
            rec.put(name, {"command": " ".join(cmd[1:]), "rc": res["rc"], "timed_out": res["timed_out"], "error": tail(res["stderr"], 8)})
    r = rec["results"]
    ratios = {s: v.get("ours_over_torch") for s, v in r.get("step_vs_torch", {}).get("result", {}).get("schedules", {}).items()} if "result" in r.get("step_vs_torch", {}) else {}
    rec["summary"] = f"ours/torch step: {ratios}" if ratios else "see the JSON"
    rec["status"] = "failed" if bad else "ok"

