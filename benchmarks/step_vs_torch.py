"""Training-step time: our DualPipeV and interleaved 1F1B (and 1F1B) vs torch.distributed.pipelining's, same model, data and ranks.

One launch of ``pp * ep`` gloo ranks (default: examples/cpu.yaml, pp=2 x ep=2). For each
schedule it builds three copies of the same model (same seed, same blocks):

- ours with the F&B overlap on (``schedule.overlap: true``),
- ours with it off (the F&B pairs run one after the other),
- torch's ``ScheduleDualPipeV`` / ``ScheduleInterleaved1F1B`` / ``Schedule1F1B`` over ``PipelineStage`` objects
  wrapping the same model blocks (block 0 embeds, the last block's head and loss are torch's
  ``loss_fn``; the expert all-to-alls run inside the stages), followed by the same gradient
  reduction over the expert-parallel replicas and the same router-bias update as ours.

Before timing, one step of each on the same data checks the three are the same computation
(loss and gradients). Then the variants take turns, step by step, so a change in machine load
hits all of them alike; every step starts at a barrier and its time is the slowest rank's.
Prints one JSON object: the median step time of each, torch / ours, and the share of
all-to-all time hidden behind compute over the step, in the steady phase (the F&B pairs) and at
the edges (the lone F, B and BW actions: warm-up, cool-down, and all of 1F1B; and F&F pairs),
the same for the routing's small exchanges of row counts (``counts_*``, apart from the rows'), each rank's
median processor time per step (all of its threads: with more ranks than cores the step is
bound by it), with the machine's load average before and after. From the processor times comes
each variant's floor (``processor_floor_s``): the shortest step they allow on this host, all
ranks' processor time over the cores they share; ours' floor over
torch's step (``ours_floor_over_torch``) is the lowest ratio any schedule could reach with ours'
processor time, and ``cores_busy_pct`` how much of the shared cores each variant kept busy.

Every variant runs in the same rank processes, in turns, so ours and torch's get the same cores
and intra-op threads: ``--pin-cores true`` (``launch.pin_cores``) binds each rank to cores of its
own, one thread per core (a fair test of the step-time claims needs a core per rank; ranks that
share cores are processor-bound); the JSON's ``placement`` gives each rank's cores and threads.

Taking each exchange's completion time (for the hidden shares) costs processor time on every
exchange, so ours takes it only on timing steps: after every ``--a2a-every`` timed steps comes
one more step of every variant on which our exchanges are timed (the executor's
``time_exchanges``). The hidden shares come from those steps alone, the step and processor
times from the others; ``median_step_s`` also gives ours' median on the timing steps
(``ours_exchanges_timed``). ``--a2a-every 0``: every step is both (the exchanges always timed).

    python benchmarks/step_vs_torch.py [--config examples/cpu.yaml] [--steps 20] [--warmup 3]
        [--a2a-every 4] [--schedules dualpipev,interleaved,1f1b] [--pin-cores auto|true|false] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import portapipe
from portapipe.ranks import pinning
from portapipe.config import Config, config_from_dict, load_config
from portapipe.data.batches import Batches, replica_of
from portapipe.ranks.launch import rank_threads, run_ranks
from portapipe.compose import PipelineRuntime, model_end_step
from portapipe.models.moe import Block
from portapipe.scheduling.overlap import Tape, run as run_program

# examples/cpu.yaml as the package ships it (a link to it in a checkout): the default works when installed, too.
DEFAULT_CONFIG = Path(portapipe.__file__).resolve().parent / "configs" / "cpu.yaml"
SCHEDULES = ("dualpipev", "interleaved")  # the default; 1f1b is the all-lone-actions case
PEERS = ("dualpipev", "interleaved", "1f1b")


class StageModule(nn.Module):
    """A model block as torch's pipeline runs it: tokens or hidden states in, hidden states out.

    The block's layers run as one ordinary autograd graph (``Tape(record=False)``: blocking,
    differentiable all-to-alls). The last block's head and loss are left to ``loss_fn``.
    """

    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, tape = self.block, Tape(record=False)
        if b.block == 0:
            x = b.embed_part(x)
        for layer in b.layers.values():
            x = run_program(layer.program(tape, x))
        return x


def torch_peer_problem(name: str) -> str | None:
    """Why torch's schedule ``name`` cannot run portapipe's blocks on this torch, or None: found by
    the presence of the code that fixed it, not by a version number."""
    from torch.distributed.pipelining import _backward

    if name == "dualpipev" and not hasattr(_backward, "_autograd_grad_for_inputs"):
        # torch 2.11 / 2.12: seen with 2.11.0 (RuntimeError: Attribute '_input_metadata' is invalid for
        # this instance of _C._FunctionBase, on portapipe RMSNorm's autograd node); torch 2.13
        # reworked the weight-gradient pass (_backward._autograd_grad_for_inputs). Before that, 2.11's
        # warm-up also sends to the rank's own stages (stages 1 and 2 of the V), which gloo cannot.
        return (f"torch {torch.__version__}'s ScheduleDualPipeV fails in its weight-gradient pass (W) on a stage holding a "
                "custom autograd.Function (portapipe's RMSNorm): its node's _input_metadata is no longer readable there; "
                "torch 2.13 reworked that pass")
    return None


class TorchPipeline:
    """torch.distributed.pipelining's schedule over the blocks of a (never stepped) PipelineRuntime.

    The runtime only lends its blocks and its post-step work (its gradient buckets, which torch's
    backward accumulates into and which are reduced over the replicas after the schedule, and
    the router-bias update), so both sides finish a step in the same state.
    """

    def __init__(self, runtime: PipelineRuntime, config: Config, backend: Any) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B

        self.rt, s, g = runtime, runtime.schedule, runtime.groups
        n_stages = s.n_stages
        last = runtime.blocks.get(s.stage_block[n_stages - 1])
        replicas = g.dp * g.ep

        m = config.schedule.microbatches

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # Seeded like ours: each micro-batch's loss / (micro-batches x replicas). torch's own
            # division of .grad by the micro-batches is off: a gradient accumulated in the buckets'
            # main_grad (another dtype than the parameter's) has no .grad for it to divide.
            return last.loss_part(output, target) / (m * replicas)

        self.local = s.stages_of(g.pp_rank)
        stages = [
            PipelineStage(StageModule(runtime.blocks[s.stage_block[v]]), v, n_stages, backend.device(), group=g.pp_group)
            for v in self.local
        ]
        name = config.schedule.name
        if name == "1f1b":  # one stage per rank
            self.schedule = Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
        else:
            cls = {"dualpipev": ScheduleDualPipeV, "interleaved": ScheduleInterleaved1F1B}[name]
            self.schedule = cls(stages, m, loss_fn=loss_fn, scale_grads=False)
        self.first, self.last = 0 in self.local, n_stages - 1 in self.local

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One step; returns the global mean loss (same on every rank)."""
        self.rt.grads.start()  # zeroed buckets, each parameter's .grad (or main_grad) a view of them
        # The public step() takes the whole batch and splits it along dim 0 into the same
        # micro-batches (equal sizes); keyword names for pre-split inputs differ between releases.
        args = (torch.cat([x for x, _ in microbatches]),) if self.first else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": torch.cat([y for _, y in microbatches]), "losses": losses} if self.last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.rt.grads.finish()  # DualPipe copies, replica sums and the reduction over the replicas, as ours
        model_end_step(self.rt)
        # each rank's losses are divided by micro-batches x replicas: their sum over ranks is the mean
        total = torch.tensor([float(sum(float(x.detach()) for x in losses))], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total)


def _config(base: dict[str, Any], name: str, overlap: bool) -> Config:
    raw = json.loads(json.dumps(base))
    raw["schedule"].update(name=name, overlap=overlap)
    return config_from_dict(raw)


def _max_rel_grad_diff(a: PipelineRuntime, b: PipelineRuntime) -> float:
    worst = 0.0
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        ga, gb = pa.grad.detach(), pb.grad.detach()
        scale = max(float(gb.abs().max()), 1e-30)
        worst = max(worst, float((ga - gb).abs().max()) / scale)
    return worst


def _in_buckets(rt: PipelineRuntime) -> bool:
    """Whether every trainable parameter's gradient (or main_grad) is a view of the runtime's gradient buckets."""
    storages = {b.grad.untyped_storage().data_ptr() for b in rt.grads.buckets if b.grad is not None}
    grads = [getattr(p, "main_grad", p.grad) for p in rt.parameters() if p.requires_grad]
    return all(g is not None and g.untyped_storage().data_ptr() in storages for g in grads)


def _all_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _all_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def timing_steps(steps: int, every: int) -> list[bool]:
    """For each step after the warm-up: whether it times our exchanges (see the module doc).
    ``steps`` are not; one that is follows every ``every`` of them (``every`` 0: all are both)."""
    if every == 0:
        return [True] * steps
    out: list[bool] = []
    for i in range(steps):
        out.append(False)
        if (i + 1) % every == 0 or i + 1 == steps:
            out.append(True)
    return out


def bench_rank(
    backend: Any, base: dict[str, Any], steps: int, warmup: int, schedules: tuple[str, ...] = SCHEDULES, a2a_every: int = 4
) -> dict[str, Any]:
    """Run on every rank: build the variants, check them against each other, time them in turns."""
    probe = config_from_dict(base)
    groups = backend.parallel_groups(probe.parallel.pp, probe.parallel.dp, probe.parallel.ep)
    data = Batches(probe)
    tc, m = probe.train, probe.schedule.microbatches

    replica, replicas = replica_of(groups)

    def batches(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return data.microbatches(i, replica, replicas, m, tc.micro_batch_size, probe.model.seq_len)

    variants: dict[str, Any] = {}
    for name in schedules:
        on, off = _config(base, name, True), _config(base, name, False)
        variants[f"{name}/ours"] = PipelineRuntime(on, backend, groups)
        variants[f"{name}/ours_no_overlap"] = PipelineRuntime(off, backend, groups)
        variants[f"{name}/torch"] = TorchPipeline(PipelineRuntime(on, backend, groups), on, backend)

    # Same computation: one step of each on the same data, weights untouched between them.
    check: dict[str, Any] = {}
    first = batches(0)
    for name in schedules:
        ours, plain, theirs = (variants[f"{name}/{k}"] for k in ("ours", "ours_no_overlap", "torch"))
        loss_ours, loss_plain, loss_torch = ours.step(first).loss, plain.step(first).loss, theirs.step(first)
        diff_torch, diff_plain = _all_max([_max_rel_grad_diff(ours, theirs.rt), _max_rel_grad_diff(ours, plain)])
        check[name] = {
            "loss_ours": loss_ours,
            "loss_ours_no_overlap": loss_plain,
            "loss_torch": loss_torch,
            "max_rel_grad_diff_torch_vs_ours": diff_torch,
            "max_rel_grad_diff_no_overlap_vs_ours": diff_plain,
            # torch's pipeline accumulates into, and is reduced through, the same gradient buckets as ours
            "torch_grads_in_buckets": bool(_all_max([0.0 if _in_buckets(theirs.rt) else 1.0])[0] == 0.0),
        }

    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}  # this rank's processor time per step
    a2a: dict[str, list[float]] = {k: [0.0] * 6 for k in variants if not k.endswith("/torch")}
    bubble: dict[str, list[float]] = {k: [] for k in a2a}
    timed_times: dict[str, list[float]] = {k: [] for k in a2a}  # ours' steps with timed exchanges
    plan = [False] * warmup + timing_steps(steps, a2a_every)
    for i, timing in enumerate(plan, start=1):
        mbs = batches(i)
        for key, v in variants.items():
            if key in a2a:
                v.time_exchanges = timing
            backend.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            result = v.step(mbs)
            elapsed, used = time.perf_counter() - t0, time.process_time() - c0
            (slowest,) = _all_max([elapsed])
            if i <= warmup:
                continue
            if key in a2a and timing:
                t = result.timings
                sums = _all_sum([t[k] for k in ("fb_a2a_total_s", "fb_a2a_wait_s", "a2a_total_s", "a2a_wait_s", "counts_a2a_total_s", "counts_a2a_wait_s")])
                a2a[key] = [x + y for x, y in zip(a2a[key], sums)]
                timed_times[key].append(slowest)
            if timing and a2a_every:
                continue  # a timing step: its times are not the step's
            times[key].append(slowest)
            cpu[key].append(used)
            if key in a2a:
                bubble[key].append(_all_max([result.timings["bubble_frac"]])[0])

    def hidden(total: float, wait: float) -> float | None:
        return None if total <= 0 else round(100.0 * max(0.0, 1.0 - wait / total), 1)

    # each rank's median processor time per step (all its threads), every rank's on every rank
    rank, world = dist.get_rank(), dist.get_world_size()
    slots = {k: [statistics.median(cpu[k]) if i == rank else 0.0 for i in range(world)] for k in cpu}
    flat = _all_sum([x for k in cpu for x in slots[k]])
    per_rank = {k: flat[j * world : (j + 1) * world] for j, k in enumerate(cpu)}

    out: dict[str, Any] = {}
    for name in schedules:
        med = {k.split("/")[1]: statistics.median(times[k]) for k in times if k.startswith(name + "/")}
        proc = {k.split("/")[1]: v for k, v in per_rank.items() if k.startswith(name + "/")}
        # the edges: every exchange outside the F&B pairs (the executor's edge_a2a_* timings)
        fb_total, fb_wait, total, wait, counts_total, counts_wait = a2a[f"{name}/ours"]
        edge_total, edge_wait = total - fb_total, wait - fb_wait
        nfb_total, nfb_wait, ntotal, nwait, _, _ = a2a[f"{name}/ours_no_overlap"]
        n_timed = max(1, len(timed_times[f"{name}/ours"]))
        nedge_total, nedge_wait = ntotal - nfb_total, nwait - nfb_wait
        med_timed = statistics.median(timed_times[f"{name}/ours"])
        out[name] = {
            "median_step_s": {**{k: round(v, 4) for k, v in med.items()}, "ours_exchanges_timed": round(med_timed, 4)},
            "torch_over_ours": round(med["torch"] / med["ours"], 3),
            "torch_over_ours_no_overlap": round(med["torch"] / med["ours_no_overlap"], 3),
            "ours_faster_pct": round(100.0 * (1.0 - med["ours"] / med["torch"]), 1),
            "a2a_hidden_steady_pct": hidden(fb_total, fb_wait),
            "a2a_hidden_step_pct": hidden(total, wait),
            "a2a_hidden_edges_pct": hidden(edge_total, edge_wait),
            # the routing's exchanges of row counts, which the three above leave out, and all together
            "counts_a2a_hidden_pct": hidden(counts_total, counts_wait),
            "a2a_hidden_step_pct_with_counts": hidden(total + counts_total, wait + counts_wait),
            "ours_over_torch": round(med["ours"] / med["torch"], 3),
            "a2a_hidden_steady_pct_no_overlap": hidden(nfb_total, nfb_wait),
            "a2a_hidden_step_pct_no_overlap": hidden(ntotal, nwait),
            "a2a_hidden_edges_pct_no_overlap": hidden(nedge_total, nedge_wait),
            "bubble_pct_ours": round(100.0 * statistics.median(bubble[f"{name}/ours"]), 1),
            "processor_ms_per_step_by_rank": {k: [round(1000.0 * x, 1) for x in v] for k, v in proc.items()},
            "processor_ours_over_torch": round(sum(proc["ours"]) / sum(proc["torch"]), 3),
            "a2a_timing_steps": len(timed_times[f"{name}/ours"]),
            # per rank and timing step: all-to-all time (issue to done) and the part spent blocked
            "a2a_total_ms_per_step": round(1000.0 * total / world / n_timed, 2),
            "a2a_wait_ms_per_step": round(1000.0 * wait / world / n_timed, 2),
            "counts_a2a_total_ms_per_step": round(1000.0 * counts_total / world / n_timed, 2),
            "counts_a2a_wait_ms_per_step": round(1000.0 * counts_wait / world / n_timed, 2),
            "same_computation": check[name],
        }
    out["placement"] = pinning.placement()  # every variant ran here: the same cores and threads
    return out


def processor_floor(result: dict[str, Any], cores: int) -> dict[str, Any]:
    """The step time the variants' processor times allow on ``cores`` shared cores (all the
    ranks' threads' work spread over every core with none idle), and how near each came to it."""
    proc = result["processor_ms_per_step_by_rank"]
    floor = {k: sum(v) / cores / 1000.0 for k, v in proc.items()}
    step = result["median_step_s"]
    return {
        "processor_floor_s": {k: round(v, 4) for k, v in floor.items()},
        "ours_floor_over_torch": round(floor["ours"] / step["torch"], 3),
        "cores_busy_pct": {k: round(100.0 * v / step[k], 1) for k, v in floor.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="[examples/cpu.yaml]")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    parser.add_argument("--a2a-every", type=int, default=4, help="a step timing our exchanges after every N timed steps (0: every step)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {', '.join(PEERS)}")
    parser.add_argument("--pin-cores", choices=list(pinning.MODES), default=None,
                        help="each rank on cores of its own, one thread per core: launch.pin_cores (ours and torch's variants share the ranks) [the config's]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got --steps {args.steps} --warmup {args.warmup}")
    if args.a2a_every < 0:
        parser.error(f"--a2a-every must be >= 0 (0: time the exchanges on every step), got {args.a2a_every}")
    schedules = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
    unknown = [x for x in schedules if x not in PEERS]
    if unknown or not schedules:
        parser.error(f"--schedules {args.schedules!r}: each must be one of {', '.join(PEERS)}")
    unsupported = {name: why for name in schedules if (why := torch_peer_problem(name))}
    schedules = tuple(name for name in schedules if name not in unsupported)
    if not schedules:
        parser.error("--schedules: torch cannot run any of them here: " + "; ".join(f"{k}: {v}" for k, v in unsupported.items()))
    pin = [f"launch.pin_cores={args.pin_cores}"] if args.pin_cores else []
    config = load_config(args.config, ["backend=cpu", *args.overrides, *pin])
    if "interleaved" in schedules and config.schedule.microbatches % config.parallel.pp:
        parser.error(f"interleaved needs schedule.microbatches ({config.schedule.microbatches}) divisible by pp ({config.parallel.pp})")
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    results = run_ranks(
        bench_rank,
        config.world_size,
        config.to_dict(),
        args.steps,
        args.warmup,
        schedules,
        args.a2a_every,
        threads=rank_threads(config.world_size),
        wall_timeout_s=1800,
        pin_cores=config.launch.pin_cores,
    )
    placement = pinning.summary(config.launch.pin_cores, [res.pop("placement") for res in results])
    r = results[0]
    cores = len(pinning.usable_cores())
    for name in schedules:
        r[name].update(processor_floor(r[name], cores))
    report = {
        "benchmark": "step_vs_torch",
        "machine": {
            "cpus": os.cpu_count(), "cores_usable": cores, "platform": platform.platform(), "torch": torch.__version__,
            "load_avg_1m_before": round(load_before[0], 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
        },
        "placement": placement,  # each rank's cores and threads, the same for ours and torch's variants
        "ranks": config.world_size,
        "pp": config.parallel.pp,
        "ep": config.parallel.ep,
        "dp": config.parallel.dp,
        "microbatches": config.schedule.microbatches,
        "pair_forwards": config.schedule.pair_forwards,  # ours only (schedule.pair_forwards; torch's lists are its own)
        "micro_batch_size": config.train.micro_batch_size,
        "seq_len": config.model.seq_len,
        "model": {k: getattr(config.model, k) for k in ("hidden", "n_layers", "n_dense", "n_experts", "top_k", "moe_hidden", "dtype")},
        "timed_steps": args.steps,
        "a2a_every": args.a2a_every,
        "torch_unsupported": unsupported,  # schedules left out: torch's peer cannot run on this torch
        **r,
        "ours_not_slower": all(r[s]["torch_over_ours"] >= 1.0 for s in schedules),
        "ours_10pct_faster": all(r[s]["ours_faster_pct"] >= 10.0 for s in schedules),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from portapipe.cli import guarded  # errors as one line, as the CLI prints them

    sys.exit(guarded(main))
