"""Part b: the suite on this machine (pytest-xdist where present), the tests marked cuda, and the
conformance kit against the real cuda backend; pass / fail / skip counts and the failures' names."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from .common import CHECKOUT, Ctx, Record, child_env, cuda_options, cuda_reason, run_cmd, say, tail

#: the conformance kit's `pytest --pyargs` entry: the one place that names it
CONFORMANCE_KIT = "portapipe.testing"
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def pytest_counts(output: str) -> dict[str, Any]:
    """pass / fail / skip counts and the names of failures, from pytest's output (-q -rfE)."""
    counts: dict[str, Any] = {}
    lines = output.strip().splitlines()
    for line in reversed(lines):
        found = _COUNT.findall(line)
        if found and ("passed" in line or "failed" in line or "skipped" in line or "error" in line or " in " in line):
            for n, kind in found:
                counts[kind.rstrip("s") if kind in ("errors", "warnings") else kind] = int(n)
            break
    if not any(k in counts for k in ("passed", "failed", "error", "skipped")):  # cut off: count the progress characters
        marks = "".join(line.split(" ")[0] for line in lines if re.fullmatch(r"[.FEsxX]+( +\[ *\d+%\])?", line.strip()))
        if marks:
            counts.update(passed=marks.count("."), failed=marks.count("F"), error=marks.count("E"), skipped=marks.count("s"), cut_off=True)
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", output)  # "14/44 tests collected (30 deselected)"
    if collected:
        counts["collected"] = int(collected.group(1))
    counts["failures"] = [line.split(" ", 1)[1].split(" - ")[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return counts


#: more failures than this are not a flake to tell apart: they are reported as they are
RERUN_AT_MOST = 40


def rerun_failures(py: list[str], failures: list[str], timeout_s: float, env: dict[str, str], cwd: Any) -> dict[str, Any]:
    """The failed tests run once more, one process, no workers: those that pass are told apart as
    flaky (a collision of the parallel run, a port, the load), those that fail again stay failures."""
    res = run_cmd([*py, *failures], timeout_s, env, cwd=cwd)
    again = pytest_counts(res["stdout"] + res["stderr"])
    cut = res["timed_out"] or again.get("cut_off", False)
    # a node id pytest reports again failed (or whose file errored) is still failing; without a summary, all are
    still = failures if cut else [f for f in failures if any(f == g or f.startswith(g + "::") for g in again["failures"])]
    return {"command": " ".join([*py[1:], f"<{len(failures)} failed tests>"]), "rc": res["rc"], "timed_out": res["timed_out"],
            "s": res["s"], "flaky": [f for f in failures if f not in still], "still_failing": still,
            "tail": tail(res["stdout"] + res["stderr"], 8)}


def part_suite(rec: Record, ctx: Ctx) -> None:
    if CHECKOUT is None:
        rec.update(status="skipped", summary="needs a source checkout (tests/)")
        return
    reason = cuda_reason()
    py = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    try:
        import xdist  # noqa: F401

        workers = ["-n", str(min(16, os.cpu_count() or 1)), "--dist", "loadfile"]
    except ImportError:
        workers = []
    kit_options = json.dumps(cuda_options(2))
    require = {"PORTAPIPE_REQUIRE_DEVICES": "cuda"} if reason is None else {}
    runs = {
        "cuda_marked": (py + ["-m", "cuda", "tests"], require),
        "conformance_kit": (py + ["--pyargs", CONFORMANCE_KIT],
                            {"PORTAPIPE_CONFORMANCE_BACKEND": "cuda" if reason is None else "cpu", "PORTAPIPE_CONFORMANCE_OPTIONS": kit_options if reason is None else "{}"}),
        "suite": (py + workers + ["-m", "not cuda", "tests"], require),
    }
    if ctx.dry:  # collect only, on one small file: the commands, their environment and the parsing run
        runs = {name: ([*cmd[: cmd.index("-q") + 1], "--collect-only", *cmd[cmd.index("-q") + 1:]], env) for name, (cmd, env) in runs.items()}
        runs["cuda_marked"] = (runs["cuda_marked"][0][:-1] + ["tests/test_backend_cuda.py"], runs["cuda_marked"][1])
        runs["suite"] = ([c for c in runs["suite"][0][:-1] if c not in workers] + ["tests/test_gpu_check.py"], runs["suite"][1])
    rec.put("workers", workers[1] if workers else "1 (no pytest-xdist)")
    bad = 0
    for name, (cmd, extra) in runs.items():
        say(f"  b: {name}: {' '.join(cmd[2:])}")
        res = run_cmd(cmd, ctx.left(), child_env(extra), cwd=CHECKOUT)
        counts = pytest_counts(res["stdout"] + res["stderr"])
        rec.put(name, {"command": " ".join(cmd[1:]), "env": extra, "rc": res["rc"], "timed_out": res["timed_out"], "s": res["s"],
                       **counts, "tail": tail(res["stdout"] + res["stderr"], 8)})
        failed = counts["failures"]
        if name == "suite" and failed and not res["timed_out"] and len(failed) <= RERUN_AT_MOST:
            say(f"  b: {len(failed)} failed; once more, one process")
            again = rerun_failures(py, failed, ctx.left(), child_env(extra), CHECKOUT)
            rec.put("suite_rerun", again)
            bad += bool(again["still_failing"]) or res["rc"] not in (0, 1)
            continue
        bad += res["rc"] not in (0, 5) or res["timed_out"]
    r = rec["results"]
    rec["summary"] = "; ".join(
        f"{n}: " + (", ".join(f"{r[n][k]} {k}" for k in ("passed", "failed", "error", "skipped", "collected") if r[n].get(k)) or f"rc {r[n]['rc']}")
        + (" (timed out)" if r[n]["timed_out"] else "")
        + (f" ({len(r['suite_rerun']['flaky'])} passed when run again: flaky)" if n == "suite" and r.get("suite_rerun", {}).get("flaky") else "")
        for n in runs
    )
    rec["status"] = "failed" if bad else ("dry" if ctx.dry else "ok" if reason is None else "skipped")
    if reason is not None and not ctx.dry:
        rec["reason"] = reason

