"""Part k: the timeline of a DualPipeV step recorded on the GPU (``log.timeline``): device events
read once after the step, the ranks aligned, the record checked (causal order, every action once
in its order, the Chrome trace valid, each rank's time adding up) and `portapipe timeline`'s
figures beside the plan."""

from __future__ import annotations

import json
import shutil

from .common import Ctx, Record, cli, cuda_options, cuda_reason, set_args, starter, tail

STEP = 3  # the recorded step: past the first, which pays one-time costs


def part_timeline(rec: Record, ctx: Ctx) -> None:
    from portapipe.timeline import analyze, plan, trace

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    tiny = {"model.hidden": 32, "model.n_heads": 2, "model.ffn_hidden": 32, "model.moe_hidden": 16, "model.n_experts": 4,
            "model.seq_len": 16, "train.micro_batch_size": 2}
    ranks = 4  # examples/cuda_1gpu.yaml's pp 2 x ep 2 (its starter on the CPU stand-in)
    opts = {f"backend_options.{k}": v for k, v in cuda_options(ranks).items()} if device == "cuda" else {}
    folder = ctx.work / "run"
    shutil.rmtree(folder, ignore_errors=True)
    settings = {**(tiny if ctx.dry else {}), **opts, "log.dir": folder, "log.progress": "false", "checkpoint.at_end": "false",
                "data.val_fraction": 0.0, "log.timeline.steps": f"[{STEP}]"}
    config = starter("cuda_1gpu" if device == "cuda" else "cpu")
    res = cli(["train", str(config), "--steps", str(STEP), *set_args(settings)], ctx.left())
    rec.put("train", {"config": config.name, "device": device, "rc": res["rc"], "s": res["s"], "settings": {k: str(v) for k, v in settings.items()}})
    if res["rc"] != 0:
        rec.update(status="failed", summary=f"training failed: {tail(res['stderr'], 3)}")
        return
    doc = trace.read(folder, STEP)
    schedule = plan.schedule_of(doc)
    chrome_path, _ = trace.paths(folder, STEP)
    sums = {}
    for r, events in analyze.by_rank(doc).items():
        a = analyze.accounting(events)
        sums[r] = (a["compute_s"] + sum(a["exposed_s"].values()) + a["idle_s"]) / a["wall_s"]
    checks = {
        "causality": analyze.causality(doc, schedule),
        "actions": analyze.action_problems(doc, schedule),
        "trace": trace.trace_problems(json.loads(chrome_path.read_text())),
        "time_adds_up": [f"rank {r}: compute + exposed + idle = {s:.4f} of the step" for r, s in sums.items() if abs(s - 1) > 0.01],
    }
    shown = cli(["timeline", str(folder), "--step", str(STEP), "--json", "--out", str(ctx.work / "step.png")], ctx.left())
    figures = shown.get("json", {})
    rec.put("record", {"clock": doc["clock"], "events": len(doc["events"]), "alignment_bound_ms": 1e3 * max(r["alignment"]["bound_s"] for r in doc["ranks"]),
                       "checks": checks, "timeline_rc": shown["rc"]})
    rec.put("ranks", figures.get("ranks"))
    bad = [f"{k}: {v[0]}" for k, v in checks.items() if v] + ([f"portapipe timeline exited {shown['rc']}"] if shown["rc"] else [])
    a2a = [r["exposed"]["all-to-all"]["share"] for r in figures.get("ranks", [])]
    rec["summary"] = (f"{doc['clock']} clock, {len(doc['events'])} spans on {len(doc['ranks'])} ranks, aligned within "
                      f"{rec['results']['record']['alignment_bound_ms']:.3f} ms; exposed all-to-all {100 * min(a2a, default=0):.1f}-"
                      f"{100 * max(a2a, default=0):.1f}% of the step; " + ("; ".join(bad) if bad else "every check passed"))
    want_clock = "events" if device == "cuda" else "wall"
    if bad or doc["clock"] != want_clock:
        rec["status"] = "failed"
    elif device == "cuda":
        rec["status"] = "ok"
    else:
        rec.update(status="dry" if ctx.dry else "skipped", reason=reason or "dry mode")
