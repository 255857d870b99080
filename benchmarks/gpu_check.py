"""The GPU check: environment, suite, correctness, portability, speed, grouped matmul, memory, LPLB kernels, step claims, FP8, offload.

One command, run from a checkout with PYTHONPATH (nothing installed), writes ``gpu_check.json``
and a short table ``gpu_check.md`` into ``--out`` and prints the table last:

    PYTHONPATH=$PWD python3 benchmarks/gpu_check.py --parts call1 --out gpu-check/1 --budget-s 385   # a, f, h, j, k, l, b
    PYTHONPATH=$PWD python3 benchmarks/gpu_check.py --parts call2 --out gpu-check/2 --budget-s 380   # c, e, d, g, i

Parts (docs/gpu.md says what each claims and the two-call split):
  a  environment: device, compute capability, memory, torch / CUDA / NCCL / Triton, NVSHMEM, `portapipe info`
  b  the suite on this machine (pytest-xdist where present), the tests marked cuda, the conformance kit on cuda
  c  `verify` on the GPU for every schedule, 4 ranks sharing it (gloo) and one rank; EPLB, LPLB, zero-memory
     level1, recompute moe and ZeRO 2 once each: float32 on the device against float64 on the CPU
  d  portability: 20 steps on CPU continued on CUDA to 40 (and back) against 40 straight on CPU; bf16 with
     float32 master against float32, validation loss
  e  speed: a DeepSeek-V3-shaped model sized (by the planner's memory model) to fill the GPU, bf16 with
     float32 master, pp 1 ep 1: tokens/s and MFU, and transformers' DeepseekV3ForCausalLM on the same batch
  f  the experts' grouped matmul against a dense matmul of the same FLOPs, forward and backward
  g  the allocator's peak per step against the planner's memory model; what zero-memory and recompute save
  h  LPLB's Triton kernels on one layer (ep 8, 64 experts, cube, 4,096 tokens x top 8) against the CPU path
  i  step_vs_torch and balance_e2e with the machine's cores shared out one set per rank
  j  FP8: the blockwise FP8 GEMM (torch._scaled_mm, 1x128 x 128x128) against bf16 at DeepSeek-V3's shapes, and
     the GPU's FP8 matmul against the emulation within the conformance kit's bounds
  k  timeline: a DualPipeV step recorded with log.timeline on the GPU (device events), its record checked
  l  offload: the host link's H2D / D2H bandwidth through the backend's copies, how much of them a compute hides,
     and a step with memory.offload and train.optimizer_offload against one without (bit for bit, the peak's fall)

Each part runs in its own process (a CUDA fault in one cannot take the next with it), under a time
cap (``--budget-s`` for the whole command; each part's own cap below); its failure is recorded with
the traceback's tail and the next part runs. The JSON and the table are written after every part,
so a command stopped at its limit leaves everything it finished. ``--dry`` (what ``make test`` runs,
tests/test_gpu_check.py) uses tiny shapes and, without a GPU, the CPU wherever the code path allows;
a part that needs a GPU then says ``skipped`` with the reason, after its shapes, JSON and table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# the parts: benchmarks/gpu_check_parts/ beside this script (on the path as its folder), shipped in
# the package as this script is (portapipe/benchmarks/gpu_check_parts, a link)
from gpu_check_parts.common import T0, Ctx, Record, adopt_orphans, child_env, cuda_reason, descendants, kill, run_cmd, say, tail
from gpu_check_parts.parts import BY_KEY, CALLS, PARTS


def parse_parts(text: str) -> list[str]:
    """``a,b``, ``c-i``, ``all`` or a call of :data:`CALLS` (``call1``) -> part letters in order."""
    text = CALLS.get(text.removeprefix("call"), text) if text.startswith("call") else text
    if text == "all":
        return [p.key for p in PARTS]
    keys: list[str] = []
    for item in filter(None, text.split(",")):
        if re.fullmatch(r"[a-z]-[a-z]", item):
            keys += [k for k in BY_KEY if item[0] <= k <= item[2]]
        else:
            keys.append(item)
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown or not keys:
        raise ValueError(f"--parts: {text!r} names no part or unknown ones {unknown}; parts are {', '.join(BY_KEY)} (ranges like c-i, or all, call1, call2)")
    return list(dict.fromkeys(keys))


def table(report: dict[str, Any]) -> str:
    lines = ["| part | what | status | figures | s |", "|---|---|---|---|---|"]
    for key, rec in report["parts"].items():
        status = rec["status"] + (f" ({rec['reason']})" if rec.get("reason") and rec["status"] in ("skipped", "not run") else "")
        figures = str(rec.get("summary") or rec.get("error", "")).replace("|", "/").replace("\n", " ")[:240]
        lines.append(f"| {key} | {rec['title']} | {status.replace('|', '/')} | {figures} | {rec.get('seconds', '')} |")
    head = report["machine"]
    return (f"GPU check {'(dry mode) ' if report['dry'] else ''}on {head.get('device') or 'no GPU'}, torch {head['torch']}, "
            f"{report['started']}\n\n" + "\n".join(lines) + "\n")


def write(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(table(report))


def run_child(key: str, out: Path, dry: bool, cap_s: float) -> int:
    """Run one part in this process (the driver starts it as a child); its record in out/parts/KEY.json."""
    part = BY_KEY[key]
    work = out / "work" / key
    work.mkdir(parents=True, exist_ok=True)
    rec = Record(out / "parts" / f"{key}.json", key, part.title, dry)
    rec.save()
    try:
        part.run(rec, Ctx(dry, work, time.time() + cap_s))
    except Exception as exc:
        rec["status"] = "failed"
        rec["error"] = tail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), 12)
    rec.save()
    return 0


#: how long after its cap a part's process is killed (it stops its own children at the cap)
CHILD_GRACE_S = 10.0


def caches(out: Path) -> dict[str, str]:
    """Where the parts' tools keep their caches (Triton's kernels, Hypothesis's examples): under
    ``out``, not in the home folder or the checkout, unless the caller chose a place."""
    wanted = {"TRITON_CACHE_DIR": out / "work" / "cache" / "triton", "HYPOTHESIS_STORAGE_DIRECTORY": out / "work" / "cache" / "hypothesis"}
    return {k: str(v) for k, v in wanted.items() if k not in os.environ}


def left_running(before: set[int], settle_s: float = 2.0) -> list[int]:
    """What a part left running below this process that was not there ``before`` it (a pytest or a
    launch it started, orphaned when it was killed): it would take the next part's processors and
    memory. Helpers that end with their parent (a fork server, a resource tracker) get ``settle_s``."""
    deadline = time.time() + settle_s
    while True:
        found = [pid for pid in descendants(os.getpid()) if pid not in before]
        if not found or time.time() > deadline:
            return found
        time.sleep(0.1)


def drive(keys: list[str], out: Path, dry: bool, budget_s: float) -> dict[str, Any]:
    import torch

    (out / "parts").mkdir(parents=True, exist_ok=True)
    reason = cuda_reason()
    device = None
    if reason is None:
        from portapipe.backends import get_backend

        device = get_backend("cuda").describe().get("device_name")
    report: dict[str, Any] = {
        "benchmark": "gpu_check", "dry": dry, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv),
        "budget_s": budget_s or None, "machine": {"device": device, "why_no_gpu": reason, "torch": torch.__version__,
                                                  "cores": os.cpu_count(), "python": platform.python_version()},
        "parts": {k: {"part": k, "title": BY_KEY[k].title, "status": "not run", "summary": ""} for k in keys},
    }
    write(out, report)
    for key in keys:
        part = BY_KEY[key]
        left = budget_s - (time.time() - T0) if budget_s else float("inf")
        cap = min(part.cap_dry_s if dry else part.cap_s, left - 5)
        if key == keys[-1] and budget_s:  # the last part may take what the budget leaves (its kill included)
            cap = max(cap, left - 5 - CHILD_GRACE_S)
        if cap < 10:
            report["parts"][key].update(status="not run", reason=f"the budget of {budget_s:.0f} s is spent")
            say(f"{key}: not run, the budget is spent")
            write(out, report)
            continue
        say(f"{key}: {part.title} (cap {cap:.0f} s)")
        path = out / "parts" / f"{key}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--out", str(out), "--cap-s", str(cap)] + (["--dry"] if dry else [])
        before = set(descendants(os.getpid()))
        res = run_cmd(cmd, cap + CHILD_GRACE_S, child_env({**caches(out), **({"TRITON_INTERPRET": "1"} if dry and key == "h" else {})}))
        leftovers = left_running(before)
        kill(leftovers)
        rec = json.loads(path.read_text()) if path.exists() else {"part": key, "title": part.title, "results": {}}
        if res["timed_out"]:
            rec.update(status="timeout", error=f"stopped at its cap of {cap:.0f} s; what it finished is kept")
        elif res["rc"] != 0 or rec.get("status") in (None, "running"):
            rec.update(status="crashed", error=f"exit code {res['rc']}: " + tail(res["stderr"], 12))
        if leftovers:
            rec["leftover_processes_killed"] = len(leftovers)
        if res.get("left_running"):  # outlived the kill at its cap (stuck in the kernel)
            rec["left_running_after_kill"] = res["left_running"]
        if res.get("tracking"):
            rec["tracking"] = res["tracking"]
        rec["seconds"] = res["s"]
        report["parts"][key] = rec
        write(out, report)
        say(f"{key}: {rec['status']}: {str(rec.get('summary') or rec.get('error', ''))[:200]}")
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    write(out, report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Parts: " + "; ".join(f"{p.key} {p.title}" for p in PARTS))
    ap.add_argument("--parts", default="all", help="e.g. a,b or c-i or all; call1 / call2: the two calls of docs/gpu.md [all]")
    ap.add_argument("--out", default="gpu-check", help="folder for gpu_check.json and gpu_check.md [gpu-check]")
    ap.add_argument("--dry", action="store_true", help="tiny shapes; the CPU stands in where there is no GPU (make test)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="the whole command's time; parts that would start past it are not run [none]")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--cap-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.child:
        return run_child(args.child, out, args.dry, args.cap_s)
    try:
        keys = parse_parts(args.parts)
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    if args.budget_s < 0:
        print(f"gpu_check: --budget-s: {args.budget_s} is negative; give seconds, or 0 for no budget", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    adopt_orphans()
    report = drive(keys, out, args.dry, args.budget_s)
    print(table(report), flush=True)
    bad = [k for k, r in report["parts"].items() if r["status"] in ("failed", "crashed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
