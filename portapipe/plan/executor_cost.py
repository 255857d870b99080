"""The executor's own work per action, measured on a real step (``portapipe profile``).

Beyond its parts, exchanges and point-to-point posts, each action the executor runs costs its
rank's thread some work of its own: finding the action's inputs, stitching the stage's autograd
graph to its neighbours', keeping what the backward needs, the step's bookkeeping. The time
model charges it per action (``Profile.action_s``). Measured on the config's layout under 1F1B
with weight gradients computed in the backward (so an observer on the tape sees every part's
work), memory options off: the thread's processor time of a step, less the parts' (observed),
over the profile's crowding of that many ranks, less the parts' per-call overhead, the
exchanges' issuing and the posts' (from the profile so far), over the actions the rank ran; the
mean over the ranks of the median over steps.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config.setup import Setup
from .measure_parts import PartTimer
from .profile import Profile
from .time_model import TimeModel


def action_cost(backend: Any, raw: dict[str, Any], profile: Profile, reps: int, warmup: int) -> float:
    """Seconds per action; every rank of the config's world calls it (collectives)."""
    from ..config import config_from_dict
    from ..scheduling.executor import build_schedule
    from ..scheduling.overlap import observing
    from ..verify.pipelined import runtime_for

    raw = copy.deepcopy(raw)
    plain = config_from_dict(raw)
    raw["schedule"].update(name="1f1b", w_split=False, microbatches=max(plain.schedule.microbatches, plain.parallel.pp))
    raw["memory"] = {"zero_memory": "off", "recompute": "none"}
    config = config_from_dict(raw)
    rt, data = runtime_for(backend, raw)
    rank = rt.groups.pp_rank
    model = TimeModel(Setup.from_config(config), profile, build_schedule(config))
    actions = [a for a in model.lists[rank] if a.__class__ is not tuple and a.kind.is_compute]
    issued = sum(model.exchanges(a) for a in actions)
    known = issued * profile.issue_time(config.parallel.ep) + model.posts_per_rank[rank]
    crowding = profile.crowded(config.world_size)
    rest = []
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
        rest.append((used - parts, overhead + known))
    # the rest of the thread's time, as uncrowded seconds, less what the profile knows of it
    mine = torch.tensor([max(0.0, statistics.median(r / crowding - k for r, k in rest) / len(actions))], dtype=torch.float64)
    dist.all_reduce(mine)
    return float(mine) / dist.get_world_size()
