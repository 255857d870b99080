"""How well `portapipe plan` predicts: step time and peak saved activations, predicted vs measured.

In each of ``--rounds`` rounds (a virtual machine's speed drifts with its host's other work, by
some 10-20% over minutes here, and rounds average the drift out):

1. Profile: ``portapipe profile`` of the base config (examples/cpu.yaml unless ``--config``), on
   its ranks, here and now (``--profile P`` reuses a file).
2. Accuracy: for each configuration below (the five schedules, memory off / level0 / level1 /
   recompute norms, 2 and 4 ranks, F&F pairs once, multi-token prediction twice, all from the base config), the
   time model's step time against the median of measured steps (``runtime.step`` plus AdamW's
   update, the slowest rank, each step started at a
   barrier; the configurations of one rank count take turns step by step, so a change in the
   machine's load hits all of them alike), and the memory model's peak saved-activation bytes
   per pipeline rank against :class:`~portapipe.memory.accounting.SavedActivations` on a tracked
   step (mean over the EP peers of that pipeline rank), and per rank given the rows that rank's
   step routed (``MemoryModel(routing=...)``). Each pipeline rank's processor time
   against the time model's demand, the processor time other processes and the host took
   meanwhile, and a fixed computation's processor time before and after (the machine's speed).
3. Plan (first round's profile): ``portapipe plan`` of the base config on its device count; its
   top 4 candidates and the base config itself take turns with the configurations. The top
   choice should be no slower than any of the others: the median over steps of its step time
   over the other's in the same turn.

A configuration's error is its median prediction over the rounds against the median of its
measured medians. Then DeepSeek-V3: ``portapipe plan examples/plan/deepseek_v3.yaml --devices
2048 --memory 80GiB --profile h800`` timed as a command (interpreter start included), and the
memory model's DualPipe figures for that shape (parameters against 1F1B's, micro-batches in
flight), and (``fit``) DeepSeek's own setup with each piece of its memory recipe added in turn:
every rank's bytes by kind and the step the time model gives it on the published H800. Last,
the Hugging Face architectures (``architectures``): the memory model's peak saved
bytes per rank against the accounting on one step of examples/deepseek_v3.yaml (MLA) and
examples/qwen3_moe.yaml (GQA), DualPipeV on 2 ranks (pp2) and 4 (pp2 x ep2), and DeepSeek-V3's
memory recipe all together on MLA (FP8, FP8-cached activations, recompute norms, bfloat16
moments; 2 and 4 ranks, ``--only recipe`` alone), and ``memory.offload`` on every schedule and
architecture, with the recipe, zero-memory, the norms' recompute and EPLB (the peak device bytes;
``--only offload`` alone); goal within 1% per rank, each rank's prediction given its own routing
(the mean routing's beside it).

Prints one JSON object (machine, load average before and after, every figure).

    python benchmarks/plan_accuracy.py [--rounds 3] [--steps 8] [--warmup 2] [--profile P] [--only NAME,...]
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

from portapipe.config import Config, config_from_dict, load_config
from portapipe.ranks.launch import run_ranks
from portapipe.memory.accounting import SavedActivations
from portapipe.plan.imbalance import imbalance
from portapipe.plan.measure import profile_rank
from portapipe.plan.memory_model import MemoryModel
from portapipe.plan.planner import plan
from portapipe.plan.profile import Profile
from portapipe.config.setup import Setup
from portapipe.plan.time_model import TimeModel
from portapipe.scheduling.executor import build_schedule
from portapipe.training.update import make_sharded_optimizer
from portapipe.verify.pipelined import recording_rows, routed_rows, routed_step, runtime_for

ROOT = Path(__file__).resolve().parents[1]
#: DeepSeek-V3's published training rate: 14.8T tokens in 2.664M H800 GPU-hours
PUBLISHED_TOKENS_PER_GPU_S = 14.8e12 / (2.664e6 * 3600)

# name -> overrides of the base config
CONFIGS: dict[str, list[str]] = {
    "1f1b-pp2": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b"],
    "zb1p-pp2": ["parallel.pp=2", "parallel.ep=1", "schedule.name=zb1p"],
    "interleaved-pp2": ["parallel.pp=2", "parallel.ep=1", "schedule.name=interleaved"],
    "dualpipe-pp2": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipe"],
    "dualpipev-pp2-level1": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipev", "memory.zero_memory=level1"],
    "dualpipev-ep2-level0": ["parallel.pp=1", "parallel.ep=2", "schedule.name=dualpipev", "memory.zero_memory=level0"],
    "1f1b-ep2": ["parallel.pp=1", "parallel.ep=2", "schedule.name=1f1b"],
    "dualpipev-pp2-ep2": ["parallel.pp=2", "parallel.ep=2", "schedule.name=dualpipev"],
    "dualpipe-pp2-ep2-level1": ["parallel.pp=2", "parallel.ep=2", "schedule.name=dualpipe", "memory.zero_memory=level1"],
    "zb1p-pp4": ["parallel.pp=4", "parallel.ep=1", "schedule.name=zb1p"],
    "interleaved-pp2-ep2-level0": ["parallel.pp=2", "parallel.ep=2", "schedule.name=interleaved", "memory.zero_memory=level0"],
    "1f1b-pp2-ep2": ["parallel.pp=2", "parallel.ep=2", "schedule.name=1f1b"],
    "dualpipev-pp2-ep2-ff": ["parallel.pp=2", "parallel.ep=2", "schedule.name=dualpipev", "schedule.pair_forwards=true"],
    # multi-token prediction (a module on the last stage, its embedding's copy), with the balance loss
    "1f1b-pp2-mtp1": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "model.mtp_layers=1", "train.seq_aux_loss_weight=0.0001"],
    "dualpipev-pp2-ep2-mtp1": ["parallel.pp=2", "parallel.ep=2", "schedule.name=dualpipev", "model.mtp_layers=1"],
    # recompute norms: alone on 2 ranks, with recompute moe and with level1 on 4
    "1f1b-pp2-norms": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "memory.recompute=norms"],
    "zb1p-pp4-norms-level1": ["parallel.pp=4", "parallel.ep=1", "schedule.name=zb1p", "memory.recompute=norms", "memory.zero_memory=level1"],
    "dualpipev-pp2-ep2-norms+moe": ["parallel.pp=2", "parallel.ep=2", "schedule.name=dualpipev", "memory.recompute=norms+moe"],
}
# FP8-cached activations: the widths multiples of 128 in bfloat16 under train.fp8 (its time is the
# CPU's FP8 emulation, which the profile of the base config does not price: the bytes are the point)
FP8_ACTIVATIONS = ["model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=128", "model.dtype=bfloat16", "train.fp8=deepseek",
                   "memory.fp8_activations=true"]
CONFIGS["fp8-activations-1f1b-pp2"] = ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", *FP8_ACTIVATIONS]
CONFIGS["fp8-activations-dualpipev-pp2-ep2"] = ["parallel.pp=2", "parallel.ep=2", "schedule.name=dualpipev", *FP8_ACTIVATIONS]


def _rank(backend: Any, raws: dict[str, dict[str, Any]], steps: int, warmup: int) -> dict[str, Any]:
    """On every rank: build each config's runtime, track one step's saved bytes, then time steps in turns."""
    built = {}
    for name, raw in raws.items():
        rt, data = runtime_for(backend, raw)
        opt = make_sharded_optimizer(rt, config_from_dict(raw), rt.backend)
        opt.lr = config_from_dict(raw).train.lr
        built[name] = (rt, data, opt)
    out: dict[str, Any] = {}
    for name, (rt, data, opt) in built.items():
        tracker = SavedActivations(ignore=rt.parameters())
        with recording_rows(rt) as calls, tracker.step():
            rt.step(data)
        rt.grads.zero_grad()
        out[name] = {"pp_rank": rt.groups.pp_rank, "saved_peak": tracker.peak_bytes, "routing": routed_rows(rt, calls), "step_s": [], "cpu_s": []}
    host0, own0 = _host_times(), time.process_time()
    for i in range(warmup + steps):
        for name, (rt, data, opt) in built.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            rt.step(data)
            opt.step()
            rt.grads.zero_grad()
            cpu = time.process_time() - c0  # this rank's processor time, all its threads
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i >= warmup:
                out[name]["step_s"].append(float(dt[0]))
                out[name]["cpu_s"].append(cpu)
    # processor time the whole machine spent meanwhile, less what the ranks spent: other processes
    host1 = _host_times()
    busy = (host1[0] - host1[1] - host1[2]) - (host0[0] - host0[1] - host0[2])  # ran something
    spent = torch.tensor([busy, host1[2] - host0[2], time.process_time() - own0], dtype=torch.float64)
    dist.all_reduce(spent)
    world = dist.get_world_size()
    out["_machine"] = {"busy_s": float(spent[0]) / world, "steal_s": float(spent[1]) / world, "ranks_s": float(spent[2])}
    return out


# the Hugging Face architectures' attention (deepseek_v3: MLA; qwen3_moe: GQA) on 2 and 4 ranks:
# the memory model's peak saved bytes per pipeline rank against the accounting on a real step
ARCHITECTURES: dict[str, tuple[str, list[str]]] = {
    f"{arch}-{layout}": (f"examples/{arch}.yaml", ["data.format=bytes", "data.path=null", *over])
    for arch in ("deepseek_v3", "qwen3_moe")
    for layout, over in (("dualpipev-pp2", ["parallel.pp=2", "parallel.ep=1"]), ("dualpipev-pp2-ep2", ["parallel.pp=2", "parallel.ep=2"]))
}
# DeepSeek-V3's memory recipe all together on MLA (``recipe``): FP8 with FP8-cached activations,
# the norms' and the up-projection's recompute, bfloat16 moments; as in DeepSeek-V3, q_b, kv_b, wo
# and the FFNs in FP8 (widths of 128: 128 -> 256, 128 -> 384, 256 -> 128) and kv_a not (160 wide
# as DeepSeek-V3's 576, so the normed input stays bfloat16); query / key width = value width (64),
# so that the CPU runs the fused attention kernel as an H800 would
RECIPE = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=256", "model.q_lora_rank=128",
          "model.kv_lora_rank=128", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=64",
          "train.fp8=deepseek", "train.moments_dtype=bfloat16", "memory.fp8_activations=true", "memory.recompute=norms"]
# and on GQA: wq 256, wk / wv 128 wide, all in FP8
QWEN_RECIPE = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.head_dim=64", "train.fp8=deepseek",
               "train.moments_dtype=bfloat16", "memory.fp8_activations=true", "memory.recompute=norms"]
ARCHITECTURES.update({
    f"qwen3_moe-recipe-{layout}": ("examples/qwen3_moe.yaml", ["data.format=bytes", "data.path=null", *over, *QWEN_RECIPE])
    for layout, over in (("dualpipev-pp2", ["parallel.pp=2", "parallel.ep=1"]), ("dualpipev-pp2-ep2", ["parallel.pp=2", "parallel.ep=2"]))
})
ARCHITECTURES.update({
    f"deepseek_v3-recipe-{layout}": ("examples/deepseek_v3.yaml", ["data.format=bytes", "data.path=null", *over, *RECIPE])
    for layout, over in (("dualpipev-pp2", ["parallel.pp=2", "parallel.ep=1"]), ("dualpipev-pp2-ep2", ["parallel.pp=2", "parallel.ep=2"]),
                         ("1f1b-pp2-level1", ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "memory.zero_memory=level1"]),
                         ("1f1b-pp2-ep2-level1", ["parallel.pp=2", "parallel.ep=2", "schedule.name=1f1b", "memory.zero_memory=level1"]))
})

# memory.offload (``offload``): the parts' saved tensors in host memory until one compute action
# ahead of their backward; the peak device bytes against the accounting's device bytes, on every
# architecture and schedule, with the recipe, zero-memory, recompute and EPLB (each name once in the
# part list the models have: qwen3_moe has no dense layer nor shared expert)
_ALL = "memory.offload=[attention,dense,shared,experts]"
_NO_DENSE = "memory.offload=[attention,experts]"
ARCHITECTURES.update({
    "portapipe-offload-dualpipev-pp2-ep2": ("examples/cpu.yaml", ["data.format=bytes", "data.path=null", _ALL]),
    "portapipe-offload-dualpipe-pp2-ep2-level0": ("examples/cpu.yaml", ["data.format=bytes", "data.path=null", _ALL, "schedule.name=dualpipe",
                                                                          "memory.zero_memory=level0"]),
    "portapipe-offload-zb1p-pp2-ep2-x1": ("examples/cpu.yaml", ["data.format=bytes", "data.path=null", "schedule.name=zb1p",
                                                                  "memory.offload=[attention,experts]", "memory.offload_layers=1"]),
    "portapipe-offload-interleaved-pp2-ep2-norms": ("examples/cpu.yaml", ["data.format=bytes", "data.path=null", _ALL, "schedule.name=interleaved",
                                                                             "memory.recompute=norms"]),
    "portapipe-offload-1f1b-pp2-ep2-eplb": ("examples/cpu.yaml", ["data.format=bytes", "data.path=null", _ALL, "schedule.name=1f1b",
                                                                   "balancer.kind=eplb", "balancer.redundant=1"]),
    **{f"{name}-offload": (path, over + [_NO_DENSE if name.startswith("qwen3_moe") else _ALL])
       for name, (path, over) in list(ARCHITECTURES.items()) if "level1" not in name},
})


def _saved_peaks(backend: Any, raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """On every rank: one tracked step of each config, its peak saved bytes and its routing."""
    out = {}
    for name, raw in raws.items():
        rt, peak, routing = routed_step(backend, raw)
        out[name] = {"pp_rank": rt.groups.pp_rank, "ep_rank": rt.groups.ep_rank, "saved_peak": peak, "routing": routing}
    return out


def architectures(names: list[str]) -> dict[str, Any]:
    """Per config of ``names`` and rank: predicted and measured peak saved bytes, and the relative
    error. Each rank's prediction is given the rows that rank's step routed, per micro-batch
    (``MemoryModel(routing=...)``): with EP ranks, routing differs per rank and micro-batch, and a
    peak over micro-batches sits above the mean routing's. The mean routing's prediction (what a
    plan knows) is beside it, against each rank and against the EP peers' mean."""
    out: dict[str, Any] = {}
    for ranks in (2, 4):
        cfgs = {n: load_config(ROOT / path, over) for n, (path, over) in ARCHITECTURES.items() if n in names}
        cfgs = {n: c for n, c in cfgs.items() if c.world_size == ranks}
        got = run_ranks(_saved_peaks, ranks, {n: c.to_dict() for n, c in cfgs.items()}, wall_timeout_s=1800)
        for name, cfg in cfgs.items():
            setup, schedule = Setup.from_config(cfg), build_schedule(cfg)
            report = MemoryModel(setup, schedule).report()
            rows = []
            for r in got:
                row = dict(r[name])
                routing = row.pop("routing")
                row["predicted"] = MemoryModel(setup, schedule, routing=routing).rank(row["pp_rank"]).saved_peak
                row["predicted_mean_routing"] = report.ranks[row["pp_rank"]].saved_peak
                row["error"] = row["predicted"] / row["saved_peak"] - 1
                row["mean_routing_error"] = row["predicted_mean_routing"] / row["saved_peak"] - 1
                # per stage / micro-batch / MoE layer: the rows the rank's experts ran on, over the mean
                row["rows_over_mean"] = {f"{v}/{mb}/{layer}": round(rows, 4) for (v, mb), per in sorted(routing.items()) for layer, rows, _ in per}
                rows.append(row)
            means = {p: statistics.mean(r["saved_peak"] for r in rows if r["pp_rank"] == p) for p in {r["pp_rank"] for r in rows}}
            mean_err = [report.ranks[p].saved_peak / m - 1 for p, m in means.items()]
            out[name] = {"ranks": rows, "error_abs_max": max(abs(r["error"]) for r in rows),
                         "mean_routing_error_abs_max": max(abs(r["mean_routing_error"]) for r in rows),
                         "ep_mean_error_abs_max": max(abs(e) for e in mean_err),
                         "within_1pct": all(abs(r["error"]) <= 0.01 for r in rows)}
    return out


def _host_times() -> tuple[float, float, float]:
    """Seconds since boot the host's processors were there in all, of them idle, and of them
    taken away by a virtual machine's host (steal) (Linux's /proc/stat; zeros elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]] + [0] * 8
    except (OSError, ValueError):
        return 0.0, 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return sum(fields[:8]) / tick, (fields[3] + fields[4]) / tick, fields[7] / tick


def _reference(seconds: float = 0.3) -> float:
    """Processor seconds per unit of a fixed computation (small matrix products): the machine's
    speed now, which on a virtual machine drifts with its host's other work."""
    torch.set_num_threads(1)
    a = torch.randn(96, 96)
    t0, n = time.thread_time(), 0
    while n < 200 or time.thread_time() - t0 < seconds:
        a = torch.tanh(a @ a)
        n += 1
    return (time.thread_time() - t0) / n * 1e3


def measure(configs: dict[str, Config], steps: int, warmup: int) -> dict[str, Any]:
    """Measured figures of every config, one launch per world size."""
    out: dict[str, Any] = {}
    by_world: dict[int, dict[str, Config]] = {}
    for name, c in configs.items():
        by_world.setdefault(c.world_size, {})[name] = c
    for world, group in sorted(by_world.items()):
        backend = next(iter(group.values())).backend
        per_rank = run_ranks(_rank, world, {n: c.to_dict() for n, c in group.items()}, steps, warmup, backend=backend, wall_timeout_s=3600)
        machine = per_rank[0].pop("_machine")
        out.setdefault("_others", {})[str(world)] = {
            "others_cpu_s": max(0.0, machine["busy_s"] - machine["ranks_s"]), "steal_s": machine["steal_s"],
        }
        for name, c in group.items():
            setup, schedule = Setup.from_config(c), build_schedule(c)
            saved: dict[int, list[int]] = {}
            for r in per_rank:
                saved.setdefault(r[name]["pp_rank"], []).append(r[name]["saved_peak"])
            times = per_rank[0][name]["step_s"]
            out[name] = {
                "world": world,
                "step_s_median": statistics.median(times),
                "step_s_min": min(times),
                "step_s_all": times,
                # a rank's processor time (all its threads), mean over the ranks of each pipeline rank
                "cpu_s_per_pp_rank": [
                    statistics.mean(statistics.median(r[name]["cpu_s"]) for r in per_rank if r[name]["pp_rank"] == p) for p in sorted(saved)
                ],
                "saved_peak_per_pp_rank": [statistics.mean(saved[p]) for p in sorted(saved)],
                "saved_peak_per_rank": [r[name]["saved_peak"] for r in per_rank],
                # the memory model given each rank's own routing in the tracked step
                "saved_peak_routed_predicted_per_rank": [
                    MemoryModel(setup, schedule, routing=r[name]["routing"]).rank(r[name]["pp_rank"]).saved_peak for r in per_rank
                ],
            }
    return out


def predict(config: Config, profile: Profile) -> dict[str, Any]:
    setup = Setup.from_config(config)
    schedule = build_schedule(config)
    imb = imbalance(profile.loads, setup.ep, config.balancer, config.model.n_groups)
    t = TimeModel(setup, profile, schedule, imb).predict()
    mem = MemoryModel(setup, schedule).report()
    return {"step_s": t.step_s, "time": t.to_dict(), "cpu_s_per_pp_rank": t.per_rank_cpu, "saved_peak_per_pp_rank": [r.saved_peak for r in mem.ranks]}


def compare(preds: list[dict[str, Any]], meas: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over the rounds: the median predicted step against the median of the
    rounds' measured medians; peak saved bytes from the first round (they do not vary)."""
    predicted = statistics.median(p["step_s"] for p in preds)
    measured = statistics.median(m["step_s_median"] for m in meas)
    time_err = predicted / measured - 1.0
    mem_err = [p / m - 1.0 for p, m in zip(preds[0]["saved_peak_per_pp_rank"], meas[0]["saved_peak_per_pp_rank"])]
    routed_err = [p / m - 1.0 for p, m in zip(meas[0]["saved_peak_routed_predicted_per_rank"], meas[0]["saved_peak_per_rank"])]
    return {
        "step_s_predicted": predicted,
        "step_s_measured_median": measured,
        "time_error": time_err,
        "time_within_15pct": abs(time_err) <= 0.15,
        "step_s_predicted_per_round": [p["step_s"] for p in preds],
        "step_s_measured_median_per_round": [m["step_s_median"] for m in meas],
        "step_s_measured_min": min(m["step_s_min"] for m in meas),
        # the time model's processor demand (the schedule's actions) against each pipeline rank's
        # processor time (the step with its optimizer update), per round
        "cpu_s_predicted": [p["cpu_s_per_pp_rank"] for p in preds],
        "cpu_s_measured": [m["cpu_s_per_pp_rank"] for m in meas],
        "saved_peak_predicted": preds[0]["saved_peak_per_pp_rank"],
        "saved_peak_measured": meas[0]["saved_peak_per_pp_rank"],
        "saved_peak_error_worst": max(mem_err, key=abs),
        "saved_within_5pct": all(abs(e) <= 0.05 for e in mem_err),
        # per rank, the model given the rank's own routing (the mean routing's above: against the EP peers' mean)
        "saved_peak_routed_error_worst": max(routed_err, key=abs),
        "saved_peak_routed_within_1pct": all(abs(e) <= 0.01 for e in routed_err),
        "predicted": preds[0]["time"],
        "world": meas[0]["world"],
    }


def deepseek() -> dict[str, Any]:
    """The DeepSeek-V3 plan's wall time, its top row, and DualPipe's memory properties on that shape."""
    import resource
    import subprocess

    path = ROOT / "examples" / "plan" / "deepseek_v3.yaml"
    cmd = [sys.executable, "-m", "portapipe.cli", "plan", str(path), "--devices", "2048", "--memory", "80GiB", "--profile", "h800", "--json", "--top", "3"]
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)  # the command's processor time
    out = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    cfg = load_config(path)
    dual = Setup.from_config(cfg)
    one_cfg = load_config(path, ["schedule.name=1f1b"])
    rd = MemoryModel(dual, build_schedule(cfg)).report()
    r1 = MemoryModel(Setup.from_config(one_cfg), build_schedule(one_cfg)).report()
    tokens_s = out["ranked"][0]["tokens_per_s"] / 2048 if "ranked" in out and out["ranked"] else None
    return {
        "command": " ".join(cmd[2:]),
        "wall_s": wall,
        "cpu_s": cpu,
        "considered": out.get("considered"),
        "top": out.get("ranked", [None])[0],
        "your_config": out.get("user"),
        "top_tokens_per_gpu_s": tokens_s,
        "published_tokens_per_gpu_s": PUBLISHED_TOKENS_PER_GPU_S,
        "dualpipe_params_over_1f1b": sum(r.params for r in rd.ranks) / sum(r.params for r in r1.ranks),
        "dualpipe_microbatches_in_flight": [r.microbatches_peak for r in rd.ranks],
        "one_f_one_b_microbatches_in_flight": [r.microbatches_peak for r in r1.ranks],
        "dualpipe_peak_saved_gib": [r.saved_peak / 2**30 for r in rd.ranks],
        "dualpipe_peak_total_gib": [r.total / 2**30 for r in rd.ranks],
    }


#: DeepSeek-V3's memory recipe piece by piece on its own setup (``fit``), each row adding its ``--set``s to the ones above
FIT = [("no ZeRO", []), ("+ ZeRO-1", ["train.zero_stage=1"]), ("+ bfloat16 moments", ["train.moments_dtype=bfloat16"]),
       ("+ FP8", ["train.fp8=deepseek"]), ("+ FP8-cached activations", ["memory.fp8_activations=true"]),
       ("+ recompute norms and MLA up-projection", ["memory.recompute=norms"])]


def fit() -> dict[str, Any]:
    """examples/plan/deepseek_v3.yaml (DualPipe PP16 x EP64 x DP2) with each piece of the recipe
    added in turn: every pipeline rank's bytes by kind (rank 0 and the fullest), and the time
    model's step on the published H800 (the setup priced as if it fitted) against DeepSeek's
    ~1,540 tokens per GPU-second."""
    from portapipe.config.setup import shape_of
    from portapipe.plan.published import published

    gib = 2**30
    path = ROOT / "examples" / "plan" / "deepseek_v3.yaml"
    rows, sets = [], []

    def kinds(r: Any) -> dict[str, float]:
        return {"params": r.params / gib, "grads": r.grads / gib, "master": r.master / gib, "moments": r.optimizer / gib,
                "saved_activations": r.saved_peak / gib, "held_besides": (r.held_peak - r.saved_peak) / gib, "total": r.total / gib}

    for label, more in FIT:
        sets = sets + more
        cfg = load_config(path, sets)
        setup, sched = Setup.from_config(cfg), build_schedule(cfg)
        report = MemoryModel(setup, sched).report()
        prof = published("h800", shape_of(cfg.model, cfg.train, cfg.backend))
        step = TimeModel(setup, prof, sched, imbalance(prof.loads, setup.ep, cfg.balancer, cfg.model.n_groups)).predict().step_s
        per_gpu = setup.global_batch * cfg.model.seq_len / step / (setup.pp * setup.ep * setup.dp)
        rows.append({"row": label, "set": list(sets), "rank0": kinds(report.ranks[0]), "fullest_rank": report.worst_rank,
                     "fullest": kinds(report.ranks[report.worst_rank]), "totals_gib": [r.total / gib for r in report.ranks],
                     "fits_80gib": report.peak <= 80 * gib, "step_s": step, "tokens_per_gpu_s": per_gpu,
                     "over_published": per_gpu / PUBLISHED_TOKENS_PER_GPU_S})
    return {"config": str(path.relative_to(ROOT)), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples" / "cpu.yaml"), help="base config [examples/cpu.yaml]")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override of the base config")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of profile + measurements [3]")
    ap.add_argument("--profile", help="reuse this profile in every round instead of measuring one")
    ap.add_argument("--save-profile", help="write the first round's profile here")
    ap.add_argument("--only", help="comma-separated subset of the configurations (and 'plan', 'deepseek', 'fit', 'architectures'; "
                    "'recipe': of the architectures, DeepSeek-V3's memory recipe on MLA and GQA only; 'offload': memory.offload's)")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    base = load_config(args.config, args.set)
    only = set(args.only.split(",")) if args.only else None
    configs = {n: load_config(args.config, args.set + o) for n, o in CONFIGS.items() if only is None or n in only}
    report: dict[str, Any] = {
        "benchmark": "plan_accuracy",
        "command": "python benchmarks/plan_accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "load_average_before": load_before,
        "rounds": [],
    }
    top: list[Any] = []
    cands: dict[str, Config] = {}
    for k in range(args.rounds):
        speed = [_reference()]
        if args.profile:
            profile = Profile.load(args.profile)
        else:
            profile = Profile.from_dict(run_ranks(profile_rank, base.world_size, base.to_dict(), 5, 1, backend=base.backend, wall_timeout_s=3600)[0])
            if args.save_profile and k == 0:
                profile.save(args.save_profile)
        speed.append(_reference())
        if k == 0 and (only is None or "plan" in only):
            result = plan(base, devices=base.world_size, memory_bytes=None, profile=profile)
            top = result.ranked[:4]
            cands = {_label(i, c.setup): result.config_of(c) for i, c in enumerate(top)}
            cands["example"] = base
        # the plan's candidates take turns with the configurations of their rank count
        measured = measure({**configs, **cands}, args.steps, args.warmup)
        speed.append(_reference())
        report["rounds"].append({
            "profile": {"source": profile.source, "processors": profile.processors, "device": profile.device, "action_s": profile.action_s,
                        "crowding": profile.crowding, "a2a_lag": {n: vars(v) for n, v in profile.a2a_lag.items()}},
            # ms of processor time per unit of fixed work before and after the profile and after
            # the measurements: how much the machine's speed drifted
            "reference_ms": speed,
            "others": measured.pop("_others", {}),
            "predicted": {n: predict(c, profile) for n, c in {**configs, **cands}.items()},
            "measured": measured,
        })
    rounds = report["rounds"]
    acc = {n: compare([r["predicted"][n] for r in rounds], [r["measured"][n] for r in rounds]) for n in configs}
    report["accuracy"] = acc
    if acc:
        report["accuracy_summary"] = {
            "configs": len(acc),
            "time_within_15pct": sum(a["time_within_15pct"] for a in acc.values()),
            "saved_within_5pct": sum(a["saved_within_5pct"] for a in acc.values()),
            "time_error_abs_max": max(abs(a["time_error"]) for a in acc.values()),
            "saved_error_abs_max": max(abs(a["saved_peak_error_worst"]) for a in acc.values()),
            "time_within_15pct_per_round": [
                sum(abs(r["predicted"][n]["step_s"] / r["measured"][n]["step_s_median"] - 1) <= 0.15 for n in configs) for r in rounds
            ],
        }
    if cands:
        first = next(iter(cands))
        others = {}
        for n in cands:
            # each step of the top choice against the same step of another, taken in turns: the
            # machine's drift hits both alike
            ratios = [a / b for r in rounds for a, b in zip(r["measured"][first]["step_s_all"], r["measured"][n]["step_s_all"])]
            others[n] = {
                "predicted_step_s": statistics.median(r["predicted"][n]["step_s"] for r in rounds),
                "measured_median_s": statistics.median(r["measured"][n]["step_s_median"] for r in rounds),
                "top_over_this_median": statistics.median(ratios),
            }
        report["plan"] = {
            "candidates": others,
            "top_not_slower_than_each": all(o["top_over_this_median"] <= 1.0 for o in others.values()),
            "top_not_slower_than_each_by_medians": all(others[first]["measured_median_s"] <= o["measured_median_s"] for o in others.values()),
            "top_within_5pct_of_the_fastest": others[first]["measured_median_s"] <= 1.05 * min(o["measured_median_s"] for o in others.values()),
        }
    if only is None or "deepseek" in only:
        report["deepseek_v3"] = deepseek()
    if only is None or "fit" in only:
        report["deepseek_v3_fit"] = fit()
    if only is None or "architectures" in only:
        report["architectures"] = architectures(list(ARCHITECTURES))
    elif "recipe" in only:
        report["architectures"] = architectures([n for n in ARCHITECTURES if "-recipe-" in n])
    elif "offload" in only:
        report["architectures"] = architectures([n for n in ARCHITECTURES if "offload" in n])
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


def _label(i: int, x: Setup) -> str:
    return f"plan#{i + 1} {x.schedule} pp{x.pp} ep{x.ep} dp{x.dp} m{x.microbatches} {x.memory_label()}"


if __name__ == "__main__":
    sys.exit(main())
