"""Our schedules beside torch.distributed.pipelining's, priced by the same simulator.

torch builds its per-rank action lists (``pipeline_order``) when a schedule object is made;
that needs only stage objects answering a few attributes, so no process group is started.
Each list is converted to our IR (F -> F, I -> B, W -> W, B -> BW, OVERLAP_F_B -> F&B pair),
checked with our validator, lowered and simulated with the same costs as ours.

Note on torch's Schedule1F1B: its action list numbers the last rank's forwards 1..m (its
executor runs 0..m-1), so forwards are renumbered in list order for that schedule only.

    python benchmarks/schedules_vs_torch.py [--quick]

prints one JSON object: per (torch schedule, sizes, costs) both bubbles and makespans.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed.pipelining.schedules as T

from portapipe.scheduling.comms import lower_comms
from portapipe.scheduling.ir import Action, Kind, Schedule, fb
from portapipe.scheduling.schedules import build, one_pipeline, v_shape
from portapipe.scheduling.simulate import Costs, simulate
from portapipe.scheduling.validate import problems

_KIND = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": Kind.BW}


def _stages(pp: int, n_stages: int, rank: int, style: str) -> list[SimpleNamespace]:
    if style == "v":
        idx = [rank, n_stages - 1 - rank]
    else:
        idx = [rank + i * pp for i in range(n_stages // pp)]
    return [
        SimpleNamespace(num_stages=n_stages, group_size=pp, group_rank=rank, stage_index=i, is_first=i == 0, is_last=i == n_stages - 1, submod=None)
        for i in idx
    ]


def torch_order(cls: type, pp: int, m: int, chunks: int = 2) -> tuple[dict[int, list[Any]], str, int]:
    """(pipeline_order, placement style, number of stages) of a torch schedule class."""
    if cls is T.Schedule1F1B:
        return cls(_stages(pp, pp, 0, "loop")[0], m).pipeline_order, "loop", pp
    style = "v" if cls in (T.ScheduleZBVZeroBubble, T.ScheduleDualPipeV) else "loop"
    n_stages = 2 * pp if style == "v" else chunks * pp
    return cls(_stages(pp, n_stages, 0, style), m).pipeline_order, style, n_stages


def _convert_action(a: Any) -> Action | None:
    if a is None:
        return None
    kind = a.computation_type.value
    if kind == "OVERLAP_F_B":
        f, b = (_convert_action(x) for x in a.sub_actions)
        assert f is not None and b is not None
        return fb(f, b)
    if kind not in _KIND:
        return None  # REDUCE_GRAD, UNSHARD, RESHARD: not compute
    return Action(_KIND[kind], a.stage_index, a.microbatch_index)


def to_ir(name: str, order: dict[int, list[Any]], style: str, n_stages: int, pp: int, m: int) -> Schedule:
    actions = [[c for c in map(_convert_action, order[r]) if c is not None] for r in range(pp)]
    if name == "Schedule1F1B":
        fixed = []
        for acts in actions:
            k = iter(range(m))
            fixed.append([Action(Kind.F, a.stage, next(k)) if a.kind is Kind.F else a for a in acts])
        actions = fixed
    stage_rank = v_shape(pp) if style == "v" else [s % pp for s in range(n_stages)]
    return one_pipeline(f"torch:{name}", m, stage_rank, actions)


PAIRS = [  # torch class, our schedule, why the two may differ
    (T.Schedule1F1B, "1f1b", "same schedule"),
    (T.ScheduleInterleaved1F1B, "interleaved", "same order; ours pairs steady F and B into F&B units and warms up one more forward"),
    (
        T.ScheduleInterleavedZeroBubble,
        "interleaved",
        "not like for like: torch splits B/W to fill bubbles, our interleaved keeps full backwards and overlaps F&B instead; "
        "compare makespans where FB < F+B",
    ),
    (
        T.ScheduleZBVZeroBubble,
        "dualpipev",
        "same V placement; ZBV runs F and B separately with B/W split (smaller bubble), DualPipeV trades bubble for F&B "
        "overlap (the all-to-all hiding), so its makespan wins only when FB < F+B",
    ),
    (T.ScheduleDualPipeV, "dualpipev", "same schedule"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one size, one cost point")
    args = ap.parse_args(argv)
    sizes = [(4, 8)] if args.quick else [(4, 8), (4, 16), (8, 16), (8, 32)]
    costs = [Costs(1, 2, 1, 2.5)] if args.quick else [Costs(1, 2, 1, fb_) for fb_ in (2.0, 2.5, 3.0)] + [Costs(1, 3, 1, 4.0)]
    rows = []
    t0 = time.perf_counter()
    for cls, ours_name, note in PAIRS:
        for pp, m in sizes:
            order, style, n_stages = torch_order(cls, pp, m)
            theirs = to_ir(cls.__name__, order, style, n_stages, pp, m)
            bad = problems(theirs)
            ours = build(ours_name, pp, m, 2)
            for c in costs:
                row: dict[str, Any] = {
                    "torch": cls.__name__, "ours": ours_name, "pp": pp, "microbatches": m, "costs": c.to_dict(), "note": note,
                }
                if bad:
                    row["torch_invalid"] = bad[:3]
                else:
                    rt = simulate(lower_comms(theirs), c)
                    row.update(torch_bubble=rt.max_bubble, torch_makespan=rt.makespan, torch_peak_activations=max(rt.peak_activations))
                ro = simulate(lower_comms(ours), c)
                row.update(ours_bubble=ro.max_bubble, ours_makespan=ro.makespan, ours_peak_activations=max(ro.peak_activations))
                if "torch_bubble" in row:
                    row["ours_equal_or_smaller"] = row["ours_bubble"] <= row["torch_bubble"] + 1e-9
                    row["ours_makespan_equal_or_smaller"] = row["ours_makespan"] <= row["torch_makespan"] + 1e-9
                rows.append(row)
    out = {
        "benchmark": "schedules_vs_torch",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "bubble_definition": "makespan - busy time, max over ranks (F&B unit counts as FB)",
        "wall_s": round(time.perf_counter() - t0, 3),
        "rows": rows,
        "ours_equal_or_smaller_count": sum(1 for r in rows if r.get("ours_equal_or_smaller")),
        "compared": sum(1 for r in rows if "ours_equal_or_smaller" in r),
        "ours_makespan_equal_or_smaller_count": sum(1 for r in rows if r.get("ours_makespan_equal_or_smaller")),
        "torch_lists_invalid": sorted({r["torch"] for r in rows if "torch_invalid" in r}),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
