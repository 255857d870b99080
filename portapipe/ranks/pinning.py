"""Per-rank core pinning (``launch.pin_cores``): the cores a job may use, one disjoint set per rank.

The usable cores are this process's affinity (``os.sched_getaffinity``: a container or a batch
system may allow fewer than ``os.cpu_count()``), cut to the cgroup's CPU quota where one is set (a
quota of 16 CPUs over 192 visible ones pays for 16 busy threads, not 192). They are put in an order
that keeps each physical core's hardware threads side by side, package by package, then dealt out
to the ranks of this machine in contiguous runs whose sizes differ by at most one: a rank's set
holds whole physical cores of one package wherever the counts allow.

A pinned rank binds every thread it has to its set before torch starts its own, and runs as many
intra-op threads as its set has cores. ``pin_cores``: ``true`` pins and refuses a machine with
fewer usable cores than ranks; ``auto`` pins where each rank can have a core of its own and
leaves the ranks unpinned otherwise; ``false`` (the default) never pins.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Union

from ..config.text import ConfigError

PinMode = Union[bool, Literal["auto"]]
#: the modes as a command line spells them (the benchmarks' ``--pin-cores``)
MODES: dict[str, PinMode] = {"auto": "auto", "true": True, "false": False}

_CPU_SYS = Path("/sys/devices/system/cpu")
_CGROUP = Path("/sys/fs/cgroup")

#: the cores this rank was pinned to by :func:`pin` (None: not pinned)
_pinned: list[int] | None = None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota() -> int | None:
    """Whole CPUs the cgroup's quota pays for (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), at
    least 1; None where no quota is set."""
    v2 = _read(_CGROUP / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        pair = (quota, period or "100000")
    else:
        pair = (_read(_CGROUP / "cpu" / "cpu.cfs_quota_us") or "max", _read(_CGROUP / "cpu" / "cpu.cfs_period_us") or "100000")
    try:
        quota_us, period_us = int(pair[0]), int(pair[1])
    except ValueError:  # "max": no quota
        return None
    return max(1, quota_us // period_us) if quota_us > 0 and period_us > 0 else None


def topology_order(cores: list[int]) -> list[int]:
    """``cores`` by (package, physical core, number): a physical core's hardware threads side by
    side. Sorted by number where the kernel does not say."""
    keys = {}
    for cpu in cores:
        package = _read(_CPU_SYS / f"cpu{cpu}" / "topology" / "physical_package_id")
        core = _read(_CPU_SYS / f"cpu{cpu}" / "topology" / "core_id")
        if package is None or core is None or not package.lstrip("-").isdigit() or not core.isdigit():
            return sorted(cores)
        keys[cpu] = (int(package), int(core), cpu)
    return sorted(cores, key=keys.__getitem__)


def usable_cores() -> list[int]:
    """The cores this process (and the ranks it starts) may use, in the order :func:`split` deals them."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform: every core
        cores = list(range(os.cpu_count() or 1))
    ordered = topology_order(cores)
    quota = cpu_quota()
    return ordered[:quota] if quota is not None and quota < len(ordered) else ordered


def split(cores: list[int], ranks: int) -> list[list[int]]:
    """``cores`` dealt to ``ranks`` ranks in contiguous runs, the first ``len % ranks`` one longer."""
    if ranks < 1 or ranks > len(cores):
        raise ValueError(f"cannot split {len(cores)} cores into {ranks} non-empty sets")
    each, extra = divmod(len(cores), ranks)
    out, start = [], 0
    for r in range(ranks):
        size = each + (r < extra)
        out.append(cores[start : start + size])
        start += size
    return out


def plan(mode: PinMode, local_ranks: int, cores: list[int] | None = None) -> list[list[int]] | None:
    """Each local rank's cores under ``mode``, or None where the ranks stay unpinned.

    Raises ConfigError (one line naming ``launch.pin_cores``) for ``true`` with more local ranks
    than usable cores: nothing has started yet.
    """
    if mode is False:
        return None
    if mode not in (True, "auto"):
        raise ConfigError([f"launch.pin_cores: {mode!r} is not one of auto, true, false"])
    cores = usable_cores() if cores is None else cores
    if local_ranks > len(cores):
        if mode is True:
            raise ConfigError([
                f"launch.pin_cores: true gives each rank cores of its own, but this machine runs {local_ranks} ranks of the job "
                f"and this process may use {len(cores)} core{'s' * (len(cores) != 1)} ({describe(cores)}); set launch.pin_cores: auto "
                f"(pin only where every rank can have a core) or false, or run at most {len(cores)} ranks here"
            ])
        return None
    return split(cores, local_ranks)


def pin(cores: list[int]) -> None:
    """Bind every thread of this process (and the threads it starts later) to ``cores``."""
    global _pinned
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    os.sched_setaffinity(0, cores)  # this thread, whatever /proc said
    _pinned = sorted(cores)


def describe(cores: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cores):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def placement() -> dict[str, Any]:
    """This process's cores and intra-op threads, as a rank reports them."""
    import torch

    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cores = list(range(os.cpu_count() or 1))
    return {"pinned": _pinned is not None, "cores": describe(cores), "n_cores": len(cores), "threads": torch.get_num_threads()}


def summary(mode: PinMode, every: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's :func:`placement`, in rank order, as a run or a benchmark records it."""
    return {
        "pin_cores": mode,
        "pinned": all(p["pinned"] for p in every),
        "cores_by_rank": [p["cores"] for p in every],
        "threads_by_rank": [p["threads"] for p in every],
    }


def gather_placement(mode: PinMode) -> dict[str, Any]:
    """:func:`summary` of every rank's placement (a collective over the default group)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, placement())
    return summary(mode, every)
