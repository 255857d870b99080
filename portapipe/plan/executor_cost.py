"""What a real step adds to the parts' cost, measured on the config's layout (``portapipe profile``).

- **The executor's own work per action** (``Profile.action_s``): finding an action's inputs,
  stitching the stage's autograd graph to its neighbours', keeping what the backward needs,
  the step's bookkeeping. The time model charges it per action.
- **Crowding** (``Profile.crowding``): when a host's processors run more ranks than they are,
  each is switched between ranks inside its parts and finds its caches cold, so the same part
  takes more processor time than when the parts were timed on an EP group that fits the
  processors. Measured as the parts' processor time in the step over the profile's for the
  same calls, keyed by the ranks of the step.

Measured on the config's layout under 1F1B with weight gradients computed in the backward (so an
observer on the tape sees every part's work), memory options off: the thread's processor time
of a step, less the parts' (observed), over the crowding, less the parts' per-call overhead,
the exchanges' issuing and the posts' (from the profile so far), over the actions the rank ran;
the mean over the ranks of the median over steps.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from .profile import Profile
from .setup import Setup
from .time_model import TimeModel


def step_costs(backend: Any, raw: dict[str, Any], profile: Profile, reps: int, warmup: int) -> tuple[float, float]:
    """``(action_s, crowding)``; every rank of the config's world calls it (collectives)."""
    from ..config import config_from_dict
    from ..scheduling.executor import build_schedule
    from ..scheduling.overlap import observing
    from ..verify import runtime_for
    from .measure import PartTimer

    raw = copy.deepcopy(raw)
    plain = config_from_dict(raw)
    raw["schedule"].update(name="1f1b", w_split=False, microbatches=max(plain.schedule.microbatches, plain.parallel.pp))
    raw["memory"] = {"zero_memory": "off", "recompute": "none"}
    config = config_from_dict(raw)
    rt, data = runtime_for(backend, raw)
    rank = rt.groups.pp_rank
    model = TimeModel(Setup.from_config(config), profile, build_schedule(config))
    actions = [a for a in model.lists[rank] if a.__class__ is not tuple and a.kind.is_compute]
    issued = sum(op[0] == "I" for a in actions for op in model._ops(a)) if config.parallel.ep > 1 else 0
    known = issued * profile.issue_time(config.parallel.ep) + model.posts_per_rank[rank]
    rest, observed, expected = [], 0.0, 0.0
    for i in range(warmup + reps):
        timer = PartTimer()
        dist.barrier()
        t0 = time.thread_time()
        with observing(timer):
            rt.step(data)
        used = time.thread_time() - t0
        for p in rt.parameters():
            p.grad = None
        if i < warmup:
            continue
        parts = overhead = 0.0
        for (name, phase), samples in timer.samples.items():
            # a part's call overhead is in the profile's forward and input-gradient times
            per_call = profile.part_overhead_s.get("F" if phase == "F" else "B", 0.0)
            parts += sum(s for _, s in samples)
            overhead += per_call * len(samples)
            if name != "other":
                observed += sum(s for _, s in samples)
                expected += sum(profile.time(name, phase, "off", u) - per_call for u, _ in samples)
        rest.append((used - parts, overhead + known))
    sums = torch.tensor([observed, expected], dtype=torch.float64)
    dist.all_reduce(sums)
    crowding = float(sums[0] / sums[1]) if sums[1] > 0 else 1.0
    # the rest of the thread's time, as uncrowded seconds, less what the profile knows of it
    mine = torch.tensor([max(0.0, statistics.median(r / crowding - k for r, k in rest) / len(actions))], dtype=torch.float64)
    dist.all_reduce(mine)
    return float(mine) / dist.get_world_size(), crowding
