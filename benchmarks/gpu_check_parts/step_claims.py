"""Part i: the step-time claims with a core set per rank: step_vs_torch (DualPipeV and interleaved at
most 0.85x torch's step with the all-to-all at least 60% hidden over the step, 1F1B's at least 50%)
and balance_e2e at ep 4 and at pp 2 x ep 4 (EPLB and LPLB each win back at least 75% of the gap
between skewed and uniform routing), every rank bound to cores of its own (``--pin-cores true``).

Each run is its own process with its own share of the part's time, so a run cut off at its share
leaves the ones before it recorded. The dry mode runs the same benchmarks small (``--pin-cores
auto``: pinned where this machine has a core per rank), so the commands, the JSON they print and
the reading of the claims from it are checked before a GPU run depends on them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .common import CHECKOUT, Ctx, Record, last_json, run_cmd, say, tail

#: the most ranks a run of the GPU machine starts (balance_e2e at pp 2 x ep 4): each needs a core of its own
MOST_RANKS = 8
_BALANCE = ["balance_e2e.py", "--sources", "loads", "uniform", "--balancers", "none", "eplb", "lplb"]
_SCHEDULES = ["--schedules", "dualpipev,interleaved,1f1b"]
#: name -> (weight: its share of the part's time, arguments after the interpreter); in order
RUNS = {
    "step_vs_torch": (0.4, ["step_vs_torch.py", "--steps", "8", "--warmup", "2", *_SCHEDULES, "--pin-cores", "true"]),
    "balance_e2e_ep4": (0.3, [*_BALANCE, "--steps", "6", "--warmup", "2", "--pin-cores", "true", "--layouts", "ep4"]),
    "balance_e2e_pp2ep4": (0.3, [*_BALANCE, "--steps", "6", "--warmup", "2", "--pin-cores", "true", "--layouts", "pp2ep4"]),
}
DRY_RUNS = {
    "step_vs_torch": (0.5, ["step_vs_torch.py", "--steps", "1", "--warmup", "0", "--a2a-every", "0", *_SCHEDULES, "--pin-cores", "auto",
                            "--set", "model.hidden=16", "--set", "model.seq_len=8", "--set", "train.micro_batch_size=1"]),
    "balance_e2e_ep2": (0.5, [*_BALANCE, "--steps", "1", "--warmup", "0", "--pin-cores", "auto", "--layouts", "ep2"]),
}


def commands(work: Path, dry: bool) -> dict[str, tuple[float, list[str]]]:
    """The runs, in order, each with its share of the time left when it starts: the benchmarks of
    the checkout with this interpreter; balance_e2e's run folders under ``work``."""
    out: dict[str, tuple[float, list[str]]] = {}
    runs = list((DRY_RUNS if dry else RUNS).items())
    for i, (name, (weight, args)) in enumerate(runs):
        share = weight / sum(w for _, (w, _) in runs[i:])
        cmd = [sys.executable, str(CHECKOUT / "benchmarks" / args[0]), *args[1:]]
        if name.startswith("balance_e2e"):
            cmd += ["--out-dir", str(work / name)]
        out[name] = (share, cmd)
    return out


def cores_record() -> dict[str, Any]:
    """The usable cores and each rank's set at 4 and at 8 ranks (None: too few cores to pin)."""
    from portapipe.ranks import pinning

    usable = pinning.usable_cores()
    sets = {n: pinning.plan("auto", n, usable) for n in (4, MOST_RANKS)}
    return {
        "usable": len(usable), "usable_cores": pinning.describe(usable), "cpu_quota": pinning.cpu_quota(), "pin_cores": True,
        **{f"sets_{n}_ranks": None if s is None else [pinning.describe(c) for c in s] for n, s in sets.items()},
        **{f"threads_per_rank_{n}": None if s is None else [len(c) for c in s] for n, s in sets.items()},
        "pinning": "launch.pin_cores: true (the benchmarks' --pin-cores true): each rank bound to a disjoint set of the usable "
                   "cores, one intra-op thread per core; ours and torch's pipelines run in the same ranks; each result's "
                   "placement gives every rank's cores and threads",
    }


def claims(results: dict[str, Any], runs: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Issue 35's targets against what ``runs`` measured (``met`` None: not measured, and why), and
    what the runs' JSON lacks that the reading needs (a renamed key: the dry mode fails on it)."""
    found: list[dict[str, Any]] = []
    lacking: list[str] = []

    def claim(what: str, measured: float | None, goal: float, at_most: bool, why: str | None = None) -> None:
        met = None if measured is None else (measured <= goal if at_most else measured >= goal)
        found.append({"claim": what, "goal": f"{'<=' if at_most else '>='} {goal:g}", "measured": measured, "met": met,
                      **({"why_not_measured": why} if measured is None and why else {})})

    def read(row: dict[str, Any], key: str, where: str) -> Any:
        if key not in row:
            lacking.append(f"{where} has no {key!r}")
        return row.get(key)

    for run in runs:
        entry = results.get(run, {})
        failed = None if "result" in entry else f"the run did not finish: {entry.get('error') or 'not run'}"[:300]
        result = entry.get("result", {})
        if run == "step_vs_torch":
            unsupported = {} if failed else read(result, "torch_unsupported", "step_vs_torch's JSON") or {}
            for name in ("dualpipev", "interleaved", "1f1b"):
                why = failed or unsupported.get(name)  # the run failed, or torch's peer cannot run it here
                row = {} if why else (read(result, name, "step_vs_torch's JSON") or {})
                ratio, hidden = (None, None) if why else (read(row, key, f"step_vs_torch's {name}") for key in ("ours_over_torch", "a2a_hidden_step_pct"))
                if name != "1f1b":
                    claim(f"{name}: ours' step over torch's", ratio, 0.85, True, why)
                claim(f"{name}: all-to-all hidden over the step, %", hidden, 60.0 if name != "1f1b" else 50.0, False, why)
            continue
        layout = run.removeprefix("balance_e2e_")
        won = {}
        if not failed:
            row = read(read(result, "layouts", "balance_e2e's JSON") or {}, layout, "balance_e2e's layouts") or {}
            won = read(row, "gap_won_back", f"balance_e2e's {layout}") or {}
        for balancer in ("eplb", "lplb"):
            got = {} if failed else read(won, f"loads:{balancer}", f"balance_e2e's {layout} gap_won_back") or {}
            measured = None if failed else read(got, "step_time", f"balance_e2e's {layout} loads:{balancer}")
            claim(f"balance_e2e {layout}: step-time gap won back by {balancer}", measured, 0.75, False, failed)
    return found, lacking


def placements(results: dict[str, Any]) -> dict[str, Any]:
    """Each finished run's ranks, and whether pinned, with the cores and threads of each (the runs' own JSON)."""
    out: dict[str, Any] = {}
    for run, entry in results.items():
        result = entry.get("result") if isinstance(entry, dict) else None
        if not result:
            continue
        if run == "step_vs_torch":
            out[run] = result.get("placement")
        else:
            out[run] = result.get("layouts", {}).get(run.removeprefix("balance_e2e_"), {}).get("placement")
    return out


def summary(placed: dict[str, Any], found: list[dict[str, Any]]) -> str:
    """The table's line: each run's ranks and cores, then each claim measured and whether it was met."""
    def ranks(p: dict[str, Any] | None) -> str:
        if not p:
            return "?"
        n, lo, hi = len(p["cores_by_rank"]), min(p["threads_by_rank"]), max(p["threads_by_rank"])
        return f"{n} ranks x {lo if lo == hi else f'{lo}-{hi}'} cores pinned" if p["pinned"] else f"{n} ranks unpinned"

    measured = [c for c in found if c["met"] is not None]
    return ("; ".join(f"{run}: {ranks(p)}" for run, p in placed.items()) + f"; claims met {sum(c['met'] for c in measured)}/{len(measured)}"
            + "".join(f", {c['claim']} {c['measured']:.3g}{'' if c['met'] else ' (not met)'}" for c in measured))


def check_flags(rec: Record, ctx: Ctx, runs: dict[str, tuple[float, list[str]]]) -> bool:
    """Each run's flags are its benchmark's own (its --help lists them): the check a machine with
    too few cores for the runs still makes. False when one is not."""
    for script in dict.fromkeys(cmd[1] for _, cmd in runs.values()):
        name = Path(script).stem
        res = run_cmd([sys.executable, script, "--help"], ctx.left())
        flags = sorted({c for _, cmd in runs.values() if cmd[1] == script for c in cmd[2:] if c.startswith("--")})
        missing = [f for f in flags if f not in res["stdout"]]
        rec.put(name, {"command": " ".join(next(cmd for _, cmd in runs.values() if cmd[1] == script)[1:]), "help_rc": res["rc"],
                       "flags_missing": missing})
        if res["rc"] != 0 or missing:
            rec.update(status="failed", summary=f"{name}: {missing or tail(res['stderr'], 3)}")
            return False
    return True


def part_step_claims(rec: Record, ctx: Ctx) -> None:
    if CHECKOUT is None:
        rec.update(status="skipped", summary="needs a source checkout (balance_e2e reads examples/expert_loads.txt)")
        return
    cores = cores_record()
    rec.put("cores", cores)
    if not ctx.dry and cores[f"sets_{MOST_RANKS}_ranks"] is None:
        if check_flags(rec, ctx, commands(ctx.work, False)):
            rec.update(status="skipped", reason=f"{cores['usable']} usable cores: the claims need a core set for each of {MOST_RANKS} ranks",
                       summary=f"commands checked against the benchmarks' --help; {cores['usable']} usable cores")
        return
    bad = 0
    runs = commands(ctx.work, ctx.dry)
    for name, (share, cmd) in runs.items():
        say(f"  i: {name}")
        res = run_cmd(cmd, ctx.left() * share, cwd=CHECKOUT)
        try:
            rec.put(name, {"command": " ".join(cmd[1:]), "s": res["s"], "result": last_json(res["stdout"])})
        except ValueError:
            bad += 1
            rec.put(name, {"command": " ".join(cmd[1:]), "rc": res["rc"], "timed_out": res["timed_out"], "s": res["s"],
                           "error": tail(res["stderr"], 8)})
    found, lacking = claims(rec["results"], list(runs))
    rec.put("claims", found)
    placed = placements(rec["results"])
    rec.put("placement_by_run", placed)
    if lacking:
        rec.put("json_lacks", lacking)
    rec["summary"] = summary(placed, found) + (f"; the runs' JSON lacks {lacking}" if lacking else "")
    rec["status"] = "failed" if bad or lacking else ("dry" if ctx.dry else "ok")
