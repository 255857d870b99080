"""What `portapipe plan` prints and writes: the table, the user's own setup, the YAML, the plot."""

from __future__ import annotations

from typing import Any

import yaml

from .planner import Candidate, PlanResult, gib
from ..config.rules import violations

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """``80GiB``, ``80 GB``, ``512MiB``, ``1e9`` -> bytes; ValueError naming the accepted forms."""
    t = str(text).strip().lower().replace(" ", "")
    i = len(t)
    while i > 0 and t[i - 1].isalpha():
        i -= 1
    number, unit = t[:i], t[i:]
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    if unit not in UNITS or not value > 0 or value == float("inf"):
        raise ValueError(f"--memory: {text!r} is not a size; use e.g. 80GiB, 80GB, 512MiB or a number of bytes")
    return value * UNITS[unit]


def row(c: Candidate) -> dict[str, Any]:
    x, t, m = c.setup, c.time, c.memory
    out: dict[str, Any] = {
        # "ff": forwards run as F&F pairs (asked for, with blocks whose forwards exchange rows)
        "schedule": x.schedule + (f" v{x.chunks}" if x.schedule == "interleaved" else "") + (" ff" if x.paired_blocks else ""),
        "pair_forwards": bool(x.paired_blocks),
        "layout": f"{x.pp}x{x.ep}x{x.dp}",
        "pp": x.pp, "ep": x.ep, "dp": x.dp, "microbatches": x.microbatches, "micro_batch_size": x.micro_batch_size,
        "memory_option": x.memory_label(),
    }
    if t is not None:
        out.update(step_s=t.step_s, tokens_per_s=c.tokens_per_step / t.step_s if t.step_s > 0 else None, bubble_s=t.bubble_s,
                   a2a_exposed_s=t.a2a_exposed_s, a2a_s=t.a2a_s)
        if t.host_copy_s or t.optimizer_copy_s:  # offload's copies: all of them, and what the compute did not hide
            out.update(host_copy_s=t.host_copy_s, host_copy_exposed_s=t.host_copy_exposed_s, optimizer_copy_s=t.optimizer_copy_s,
                       optimizer_copy_exposed_s=t.optimizer_copy_exposed_s)
    if m is not None:
        out.update(peak_bytes=m.peak, worst_rank=m.worst_rank, saved_peak_bytes=max(r.saved_peak for r in m.ranks),
                   params_bytes=max(r.params for r in m.ranks), fullest_rank_bytes=fullest(c))
    if c.problems:
        out["problems"] = list(c.problems)
    return out


def fullest(c: Candidate) -> dict[str, float] | None:
    """The fullest pipeline rank's bytes, piece by piece: parameters, gradients, master weights,
    AdamW's moments, buffers, activations (what autograd saves at the step's peak, and what the
    schedule holds besides: exchange buffers, part outputs, sent tensors, deferred weight
    gradients), the transient after the schedule when it is the larger, and the total; apart,
    host memory, none of the device's: the EMA of the weights (``ema_host``), the optimizer's
    offloaded states (``optimizer_host``), the most saved activations offloaded at once (``activations_host``)."""
    m = c.memory
    if m is None or not m.ranks:
        return None
    r = m.ranks[m.worst_rank] if m.over is None else max(m.ranks, key=lambda q: q.total)
    after = max(0.0, r.post - r.held_peak)
    return {"rank": float(m.ranks.index(r)), "params": r.params, "grads": r.grads, "master": r.master, "moments": r.optimizer,
            "buffers": r.buffers, "activations_saved": r.saved_peak, "activations_held_besides": r.held_peak - r.saved_peak,
            "after_schedule_extra": after, "total": r.total, "ema_host": r.ema_host, "optimizer_host": r.optimizer_host,
            "activations_host": r.saved_host_peak}


def fullest_line(c: Candidate) -> str | None:
    """:func:`fullest` in one line for people."""
    f = fullest(c)
    if f is None:
        return None
    names = (("params", "params"), ("grads", "grads"), ("master", "master"), ("moments", "moments"), ("buffers", "buffers"),
             ("activations_saved", "activations saved"), ("activations_held_besides", "held besides"),
             ("after_schedule_extra", "after the schedule"))
    parts = ", ".join(f"{label} {gib(f[key])}" for key, label in names if f[key] > 0)
    kept = (("ema_host", "the EMA of the weights"), ("optimizer_host", "master weights and moments"), ("activations_host", "saved activations at most"))
    host = "; ".join(f"{label} {gib(f[key])}" for key, label in kept if f[key])
    host = f"; in host memory: {host}" if host else ""
    return f"pipeline rank {int(f['rank'])}: {parts} = {gib(f['total'])}{host}"


def table(result: PlanResult, top: int) -> str:
    shown = result.ranked[:top]
    if result.user.kept and result.user not in shown and result.user.time is not None:
        shown = shown + [result.user]
    w = max([24] + [len(c.setup.memory_label()) for c in shown])  # the memory option's column fits its longest
    head = f"{'#':>3}  {'schedule':<14} {'pp x ep x dp':<12} {'m x b':<8} {'memory':<{w}} {'step s':>9} {'tokens/s':>10} {'peak':>11} {'bubble s':>9} {'a2a exp s':>9}"
    lines = [head, "-" * len(head)]
    for c in shown:
        r = row(c)
        rank = result.ranked.index(c) + 1 if c in result.ranked else "-"
        mark = " <- your config" if c is result.user else ""
        lines.append(
            f"{rank:>3}  {r['schedule']:<14} {r['layout']:<12} {str(r['microbatches']) + 'x' + str(r['micro_batch_size']):<8} "
            f"{r['memory_option']:<{w}} {r['step_s']:>9.4g} {r['tokens_per_s']:>10.4g} {gib(r['peak_bytes']):>11} "
            f"{r['bubble_s']:>9.3g} {r['a2a_exposed_s']:>9.3g}{mark}"
        )
    return "\n".join(lines)


def summary(result: PlanResult) -> list[str]:
    """Lines about the enumeration and the user's own setup."""
    out = []
    budget = gib(result.memory_bytes) if result.memory_bytes is not None else "no budget"
    out.append(
        f"{result.considered} setups on {result.devices} devices ({budget} each): {len(result.ranked) + result.not_timed} fit, "
        f"{sum(result.dropped.values())} dropped" + (f", {result.not_timed} not simulated (cannot beat the table)" if result.not_timed else "")
    )
    for reason, n in sorted(result.dropped.items(), key=lambda kv: -kv[1]):
        out.append(f"  dropped {n}: {reason}")
    u = result.user
    if u.setup.devices != result.devices:
        out.append(f"your config runs on {u.setup.devices} devices, not {result.devices}; judged on its own:")
    if u.problems:
        out.append("your config is dropped: " + "; ".join(u.problems))
    elif u.time is not None:
        pos = result.ranked.index(u) + 1 if u in result.ranked else None
        where = f"ranks {pos} of {len(result.ranked)}" if pos else "is not among the ranked"
        best = result.ranked[0].time.step_s if result.ranked and result.ranked[0].time else None
        than = f" ({u.time.step_s / best:.2f}x the best)" if best else ""
        out.append(f"your config {where}: {u.time.step_s:.4g} s per step{than}, peak {gib(u.memory.peak)}")  # type: ignore[union-attr]
    if (line := fullest_line(u)) is not None:
        out.append(f"your config's fullest {line}")
    if result.ranked and result.ranked[0] is not u and (line := fullest_line(result.ranked[0])) is not None:
        out.append(f"the best's fullest {line}")
    for note in violations(u.setup, severity="note"):
        out.append(f"note on your config: {note}")
    out += [f"note: {line}" for line in result.notes]
    return out


def label(x: Any) -> str:
    """A setup in the table's words: schedule, pp x ep x dp, micro-batches x their size, memory option."""
    return (f"{x.schedule}{f' v{x.chunks}' if x.schedule == 'interleaved' else ''} {x.pp}x{x.ep}x{x.dp}, "
            f"{x.microbatches}x{x.micro_batch_size}, {x.memory_label()}")


def nothing_fits(result: PlanResult) -> str:
    """One line for a plan where no setup fits: the dropped setup nearest to fitting (:func:`~.planner.nearer`)
    and what it breaks or exceeds, and the layouts not tried at all."""
    line = f"no setup fits on {result.devices} devices"
    c = result.closest
    if c is not None:
        line += f": the closest, {label(c.setup)}: " + "; ".join(c.problems)
    if result.untried:
        line += ("; " if c is not None else ": ") + "layouts not tried: " + "; ".join(result.untried)
    return line


def best_yaml(result: PlanResult, c: Candidate) -> str:
    config = result.config_of(c)
    t = c.time
    head = (
        f"# written by `portapipe plan` for {result.devices} devices"
        + (f" of {gib(result.memory_bytes)}" if result.memory_bytes is not None else "")
        + (f": predicted {t.step_s:.4g} s per step, peak {gib(c.memory.peak)} per device\n" if t is not None and c.memory is not None else "\n")
    )
    return head + yaml.safe_dump(config.to_dict(), sort_keys=False)


def plot(result: PlanResult, path: str) -> None:
    """Predicted step time against peak memory of every simulated candidate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'portapipe[viz]'") from None
    fig, ax = plt.subplots(figsize=(8, 5))
    names = sorted({c.setup.schedule for c in result.ranked})
    for name in names:
        cs = [c for c in result.ranked if c.setup.schedule == name]
        ax.scatter([c.memory.peak / 2**30 for c in cs], [c.time.step_s for c in cs], s=14, label=name, alpha=0.7)  # type: ignore[union-attr]
    if result.ranked:
        b = result.ranked[0]
        ax.scatter([b.memory.peak / 2**30], [b.time.step_s], s=120, facecolors="none", edgecolors="black", label="best")  # type: ignore[union-attr]
    u = result.user
    if u.time is not None and u.memory is not None:
        ax.scatter([u.memory.peak / 2**30], [u.time.step_s], marker="x", s=80, color="red", label="your config")
    if result.memory_bytes is not None:
        ax.axvline(result.memory_bytes / 2**30, color="grey", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"portapipe plan: {result.devices} devices, {len(result.ranked)} simulated setups")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
