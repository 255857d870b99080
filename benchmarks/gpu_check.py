"""The GPU check: environment, suite, correctness, portability, speed, grouped matmul, memory, LPLB kernels, step claims.

One command, run from a checkout with PYTHONPATH (nothing installed), writes ``gpu_check.json``
and a short table ``gpu_check.md`` into ``--out`` and prints the table last:

    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out gpu-check --parts a,b --budget-s 340
    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out gpu-check --parts c-i --budget-s 340

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

Each part runs in its own process (a CUDA fault in one cannot take the next with it), under a time
cap (``--budget-s`` for the whole command; each part's own cap below); its failure is recorded with
the traceback's tail and the next part runs. The JSON and the table are written after every part,
so a command stopped at its limit leaves everything it finished. ``--dry`` (what ``make test`` runs,
tests/test_gpu_check.py) uses tiny shapes and, without a GPU, the CPU wherever the code path allows;
a part that needs a GPU then says ``skipped`` with the reason, after its shapes, JSON and table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: a source checkout (tests/ beside portapipe/); None where the benchmark runs from the package
CHECKOUT = ROOT if (ROOT / "tests").is_dir() and (ROOT / "portapipe").is_dir() else None
#: the conformance kit's `pytest --pyargs` entry: the one place that names it
CONFORMANCE_KIT = "portapipe.testing"
#: dense bf16 peak of an H100 SXM and of an H200, without sparsity (NVIDIA's data sheets), TFLOP/s
PEAK_BF16_TFLOPS = 989.0
#: the two commands of a run on one GPU (docs/gpu.md), each about 6 minutes: the caps of call 1
#: add up to 340 s, those of call 2 to 375 s; within a call the parts run in this order
CALLS = {"1": "a,b,f,h", "2": "c,e,d,g,i"}
SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")
STATUSES = ("ok", "dry", "failed", "skipped", "timeout", "crashed", "not run")


# ----------------------------------------------------------------------------- plumbing
T0 = time.time()


def say(msg: str) -> None:
    """A progress line with the time and the seconds since the command started."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the checkout first on the path (children import its code)."""
    env = os.environ.copy()
    if CHECKOUT is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_cmd(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own session, killed with its children at ``timeout_s``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or child_env(),
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return {"cmd": " ".join(cmd), "rc": proc.returncode, "timed_out": timed_out, "s": round(time.perf_counter() - t0, 1),
            "stdout": out, "stderr": err}


def last_json(text: str) -> Any:
    """The last top-level JSON value printed (progress lines may come before it)."""
    decoder = json.JSONDecoder()
    for start in reversed([i for i, ch in enumerate(text) if ch in "{[" and (i == 0 or text[i - 1] == "\n")]):
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if not text[end:].strip():
            return value
    raise ValueError("printed no JSON at its end")


def cli(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`portapipe ARGS` as a child process; its last JSON line as ``json`` when it printed one."""
    res = run_cmd([sys.executable, "-m", "portapipe.cli", *args], timeout_s, env)
    with contextlib.suppress(ValueError):
        res["json"] = last_json(res["stdout"])
    return res


def starter(name: str) -> Path:
    """A starter config shipped with portapipe (examples/NAME.yaml in a checkout)."""
    return Path(str(resources.files("portapipe") / "configs" / f"{name}.yaml"))


def cuda_reason() -> str | None:
    """Why the cuda backend cannot run here, or None (asked without creating a CUDA context)."""
    from portapipe.backends.registry import backend_class

    cls = backend_class("cuda")
    return None if cls.is_available() else cls.unavailable_reason()


def gpu_count() -> int:
    from portapipe.backends.registry import backend_class

    return int(backend_class("cuda").device_count())


def cuda_options(ranks: int) -> dict[str, str]:
    """backend_options for ``ranks`` ranks on this machine: gloo between them where they share GPUs."""
    return {"dist_backend": "gloo"} if ranks > max(1, gpu_count()) else {}


def set_args(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        out += ["--set", f"{key}={value}"]
    return out


class Record(dict):
    """One part's result, written to its file each time :meth:`save` is called."""

    def __init__(self, path: Path, key: str, title: str, dry: bool) -> None:
        super().__init__(part=key, title=title, status="running", dry=dry, summary="", results={})
        self.path = path

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def put(self, key: str, value: Any) -> None:
        self["results"][key] = value
        self.save()


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    run: Callable[[Record, "Ctx"], None]
    cap_s: float  # on the GPU machine
    cap_dry_s: float  # in the dry mode


@dataclass(frozen=True)
class Ctx:
    dry: bool
    work: Path  # this part's scratch folder
    deadline: float  # time.time() by which the part must be done

    def left(self, reserve: float = 5.0) -> float:
        return max(1.0, self.deadline - time.time() - reserve)


# ----------------------------------------------------------------------------- a environment
def part_env(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends.registry import backend_class

    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__, "checkout": str(CHECKOUT) if CHECKOUT else None,
    }
    for mod in ("triton", "transformers", "xdist", "pydantic", "numpy", "scipy"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "present")
        except Exception as exc:
            env[mod] = f"missing ({type(exc).__name__})"
    cuda = backend_class("cuda")
    env.update(cuda.software())
    env["gpus"] = gpu_count()
    reason = cuda_reason()
    if reason is None:
        from portapipe.backends import get_backend

        env["device"] = get_backend("cuda").describe()
    else:
        env["device"] = {"available": False, "why": reason}
    rec.put("environment", env)
    info = cli(["info", "--compact"], ctx.left())
    rec.put("portapipe_info", info.get("json", tail(info["stdout"] + info["stderr"])))
    dev = env["device"]
    rec["summary"] = (f"{dev.get('device_name')} cc {dev.get('capability')}, {dev.get('memory_bytes', 0) / 2**30:.0f} GiB; "
                      if reason is None else "no GPU; ") + f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, triton {env['triton']}"
    rec["status"] = "ok"


# ------------------------------------------------------------------------------- b the suite
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
        bad += res["rc"] not in (0, 5) or res["timed_out"]
    r = rec["results"]
    rec["summary"] = "; ".join(
        f"{n}: " + (", ".join(f"{r[n][k]} {k}" for k in ("passed", "failed", "error", "skipped", "collected") if r[n].get(k)) or f"rc {r[n]['rc']}")
        + (" (timed out)" if r[n]["timed_out"] else "")
        for n in runs
    )
    rec["status"] = "failed" if bad else ("dry" if ctx.dry else "ok" if reason is None else "skipped")
    if reason is not None and not ctx.dry:
        rec["reason"] = reason


# ------------------------------------------------------------------------ c correctness
def verify_configs(device: str, dry: bool) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """(label, raw config) per launch: the schedules at 4 ranks, the options at 4 ranks, one rank."""
    import yaml

    base = yaml.safe_load(starter("cpu").read_text())
    base.update(backend=device, backend_options=cuda_options(4) if device == "cuda" else {})
    if dry:  # tiny: two layers of width 16
        base["model"].update(hidden=16, n_layers=2, n_heads=2, ffn_hidden=32, moe_hidden=16, n_experts=4, seq_len=8)
        base["train"]["micro_batch_size"] = 2

    def cfg(name: str, pp: int, ep: int, **sections: dict[str, Any]) -> dict[str, Any]:
        raw = json.loads(json.dumps(base))
        raw["parallel"].update(pp=pp, ep=ep, dp=1)
        raw["schedule"].update(name=name, microbatches=4 if pp > 1 or name in ("dualpipe", "dualpipev") else 2)
        if pp * ep == 1:
            raw["backend_options"] = {}
        for section, values in sections.items():
            raw.setdefault(section, {}).update(values)
        return raw

    options = {
        "eplb": {"balancer": {"kind": "eplb", "redundant": 1}},
        "lplb": {"balancer": {"kind": "lplb", "topology": "ring", "redundant": 1}},
        "zero_memory_level1": {"memory": {"zero_memory": "level1"}},
        "recompute_moe": {"memory": {"recompute": "moe"}},
        "zero_stage_2": {"train": {"zero_stage": 2}},
    }
    if dry:  # one launch of one rank: the code path, at the least cost (DualPipe at pp 1 is refused before it)
        return {"one_rank": [(f"{name} x1", cfg(name, 1, 1)) for name in ("1f1b", "dualpipev", "dualpipe")]}
    return {
        "four_ranks": [(f"{name} pp2 x ep2", cfg(name, 2, 2)) for name in SCHEDULES],
        "options": [(f"dualpipev pp2 x ep2 + {label}", cfg("dualpipev", 2, 2, **secs)) for label, secs in options.items()],
        "one_rank": [(f"{name} x1", cfg(name, 1, 1)) for name in SCHEDULES],  # a schedule the rules refuse at one rank is named so
    }


def part_verify(rec: Record, ctx: Ctx) -> None:
    from portapipe.config import load_config
    from portapipe.verify import verify_many

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    rec.put("device", device)
    if device == "cpu":  # the GPU run's configs pass the rules here too (on the cpu backend), or say why not
        planned = {}
        for launch, labelled in verify_configs("cpu", False).items():
            for label, raw in labelled:
                try:
                    load_config(raw)
                    planned[label] = "accepted"
                except Exception as exc:
                    planned[label] = "refused: " + " ".join(str(exc).split())[:200]
        rec.put("gpu_configs", planned)
    ok = total = 0
    for launch, labelled in verify_configs(device, ctx.dry or reason is not None).items():
        runnable, refused = [], []
        for label, raw in labelled:
            try:  # the checks `portapipe verify` makes before any rank starts (the rules among them)
                runnable.append((label, load_config(raw)))
            except Exception as exc:
                refused.append({"config": label, "not_applicable": " ".join(str(exc).split())[:300]})
        say(f"  c: {launch}: {len(runnable)} configs ({len(refused)} refused by the rules)")
        try:
            reports = verify_many([c for _, c in runnable], wall_timeout_s=ctx.left())
            rows = [{"config": label, **r.summary()} for (label, _), r in zip(runnable, reports)]
        except Exception as exc:
            rows = [{"config": label, "ok": False, "error": tail("".join(traceback.format_exception_only(type(exc), exc)), 4)} for label, _ in runnable]
        ok += sum(bool(r["ok"]) for r in rows)
        total += len(rows)
        rec.put(launch, rows + refused)
    precisions = {r.get("precision") for rows in rec["results"].values() if isinstance(rows, list) for r in rows if r.get("precision")}
    rec["summary"] = f"{ok}/{total} ok on {device}, {'/'.join(sorted(precisions))} against float64 on the CPU"
    done = "ok" if ok == total else "failed"
    if device == "cpu":
        rec["reason"] = reason or "dry mode"
        done = "failed" if ok < total else ("dry" if ctx.dry else "skipped")
    rec["status"] = done


# ----------------------------------------------------------------------- d portability
def losses(metrics_path: str) -> dict[int, float]:
    """step -> loss of a run's metrics.jsonl (the steps' records)."""
    out: dict[int, float] = {}
    for line in Path(metrics_path).read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "train" and r.get("loss") is not None:
            out[int(r["step"])] = float(r["loss"])
    return out


def part_portability(rec: Record, ctx: Ctx) -> None:
    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    half, steps, val_steps = (2, 4, 4) if ctx.dry else (20, 40, 300)
    tiny = {"parallel.pp": 1, "parallel.ep": 1, "model.hidden": 16, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 32,
            "model.moe_hidden": 16, "model.n_experts": 4, "model.seq_len": 16, "train.micro_batch_size": 2}
    cfg = str(starter("cpu"))
    common = {**(tiny if ctx.dry else {}), "log.progress": "false", "checkpoint.every": half}

    def train(name: str, legs: list[tuple[str, int]], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        folder = ctx.work / name
        shutil.rmtree(folder, ignore_errors=True)
        out: dict[str, Any] = {"legs": []}
        for backend, upto in legs:
            ranks = 1 if ctx.dry else 4
            opts = {f"backend_options.{k}": v for k, v in (cuda_options(ranks) if backend == "cuda" else {}).items()}
            res = cli(["train", cfg, "--steps", str(upto), *set_args({**common, **(extra or {}), "backend": backend, "log.dir": folder, **opts})], ctx.left())
            out["legs"].append({"backend": backend, "to_step": upto, "rc": res["rc"], "s": res["s"]})
            if res["rc"] != 0 or "json" not in res:
                out["error"] = tail(res["stderr"], 6)
                return out
            out["summary"] = res["json"]
        out["losses"] = losses(out["summary"]["metrics"])
        return out

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(b), 1e-30)

    straight = train("cpu_straight", [("cpu", steps)])
    rec.put("cpu_straight", straight)
    rows = {}
    trips = {"cpu_then_" + device: [("cpu", half), (device, steps)], device + "_then_cpu": [(device, half), ("cpu", steps)]}
    for name, legs in trips.items():  # on the CPU alone the two trips are one: a resumed run
        say(f"  d: {name}")
        run = train(name, legs)
        if "losses" in run and "losses" in straight:
            common_steps = sorted(set(run["losses"]) & set(straight["losses"]))
            run["steps_compared"] = len(common_steps)
            run["max_rel_loss_diff"] = max((rel(run["losses"][s], straight["losses"][s]) for s in common_steps), default=None)
        rows[name] = run
        rec.put(name, run)
    say(f"  d: bfloat16 against float32, {val_steps} steps on {device}")
    vals = {}
    for dtype in ("float32", "bfloat16"):
        if ctx.dry and dtype == "float32":  # the straight run is this one (tiny, one rank, float32)
            vals[dtype] = straight.get("summary", {}).get("val_loss")
            continue
        run = train(f"{device}_{dtype}", [(device, val_steps)], {"model.dtype": dtype, "parallel.pp": 1, "parallel.ep": 1, "checkpoint.every": 0})
        vals[dtype] = run.get("summary", {}).get("val_loss")
        rec.put(f"val_{dtype}", {k: v for k, v in run.items() if k != "losses"})
    gap = rel(vals["bfloat16"], vals["float32"]) if None not in vals.values() else None
    rec.put("bf16_val_loss_rel_gap", gap)
    diffs = [r.get("max_rel_loss_diff") for r in rows.values()]
    tol = 1e-3  # float32 steps of a different device, compounded over the continued steps
    rec.put("tolerance", {"continuation_max_rel_loss_diff": tol, "bf16_val_loss_rel_gap": 0.005})
    good = None not in diffs and all(d <= tol for d in diffs) and gap is not None and (ctx.dry or gap <= 0.005)
    if device == "cpu":
        good = good and all(d == 0.0 for d in diffs)  # the same device: a resumed run is the straight one, bit for bit
    rec["summary"] = (", ".join(f"{n}: max rel loss diff {d:.2e}" if d is not None else f"{n}: failed" for n, d in zip(rows, diffs))
                      + (f"; bf16 val loss {100 * gap:.2f}% off float32" if gap is not None else "; bf16: failed"))
    rec["status"] = ("ok" if good else "failed") if device == "cuda" else ("failed" if not good else "dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"


# ----------------------------------------------------------------------------- e speed
#: DeepSeek-V3's architecture (multi-head latent attention, sigmoid group-limited routing over 8
#: groups, a shared expert, dense first layer) at DeepSeek-V2-Lite's widths (hidden 2048, 16 heads,
#: kv_lora_rank 512, 64 experts of width 1408, top-6), deepest first: the planner's memory model
#: picks the first that fits the device (bf16 weights, float32 master and AdamW: about 18 bytes a
#: parameter; 8 layers plan 80 GB, 6 layers 58 GB), a CUDA out-of-memory error moves on to the next.
_SPEED_SHAPE = {"hidden": 2048, "n_dense": 1, "n_heads": 16, "ffn_hidden": 10944, "moe_hidden": 1408, "top_k": 6, "n_groups": 8,
                "topk_groups": 4, "q_lora_rank": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
SPEED_MODELS: list[dict[str, Any]] = [{**_SPEED_SHAPE, "n_layers": layers, "n_experts": experts}
                                      for layers, experts in ((12, 64), (8, 64), (7, 64), (6, 64), (4, 32))]
SPEED_COMMON = {"arch": "deepseek_v3", "vocab_size": 32768, "n_shared": 1, "routed_scale": 2.5, "seq_len": 4096, "dtype": "bfloat16"}
SPEED_DRY = {"hidden": 32, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 64, "moe_hidden": 16, "n_experts": 8, "top_k": 2,
             "n_groups": 4, "topk_groups": 2, "q_lora_rank": 0, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
             "v_head_dim": 8, "seq_len": 32, "vocab_size": 256}


def speed_raw(model: dict[str, Any], device: str, dry: bool) -> dict[str, Any]:
    return {
        "backend": device, "parallel": {"pp": 1, "ep": 1, "dp": 1},
        "schedule": {"name": "1f1b", "microbatches": 2 if dry else 4},
        "model": {**SPEED_COMMON, **model, **(SPEED_DRY if dry else {}), **({"dtype": "float32"} if device == "cpu" else {})},
        "train": {"steps": 4 if dry else 10, "micro_batch_size": 1, "master_dtype": "float32", "warmup_steps": 2, "lr": 3e-4},
        "log": {"progress": False}, "checkpoint": {"every": 0},
    }


def memory_need(raw: dict[str, Any]) -> dict[str, float]:
    """The planner's memory model for ``raw``: bytes per part of the one pipeline rank."""
    from portapipe.config import load_config
    from portapipe.plan.memory_model import MemoryModel
    from portapipe.scheduling.runnable import build_schedule
    from portapipe.setup import Setup

    config = load_config(raw)
    r = MemoryModel(Setup.from_config(config), build_schedule(config)).report().ranks[0]
    return {k: float(v) for k, v in r.to_dict().items()}


def hf_model(raw: dict[str, Any], device: Any = "meta") -> tuple[Any, str, list[str]]:
    """transformers' model of ``raw``'s config with its fastest experts implementation that this
    transformers offers: (model, implementation, tried)."""
    import torch
    import transformers

    from portapipe.config import load_config
    from portapipe.models.hf import hf_config

    hf = hf_config(load_config(raw).model)
    cls = getattr(transformers, hf["architectures"][0])
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")}
    tried: list[str] = []
    # the fastest first; a transformers without one refuses it when the config or model is built
    for impl in ("grouped_mm", "batched_mm", "eager"):
        tried.append(impl)
        try:
            config = cls.config_class(**kwargs, attn_implementation="sdpa", experts_implementation=impl)
            with torch.device(device):  # built where it runs (meta: shapes only, for counting)
                model = cls(config)
            return model, impl, tried
        except Exception as exc:
            tried[-1] = f"{impl} ({type(exc).__name__}: {str(exc)[:120]})"
    raise RuntimeError(f"no experts implementation of transformers {transformers.__version__} builds this model: {tried}")


def flops_per_token(raw: dict[str, Any]) -> dict[str, Any]:
    """Model FLOPs per token by torchtitan's and Megatron's convention: 6 x the parameters a token
    passes through (routed experts counted at top_k of n_experts, the input embedding left out)
    plus the attention term 6 x layers x seq x heads x (q/k width + v width)."""
    m = raw["model"]
    model, _, _ = hf_model(raw)
    total = active = embed = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if "embed_tokens" in name:
            embed += n
            continue
        active += n * m["top_k"] / m["n_experts"] if ".experts." in name else n
    attention = 6 * m["n_layers"] * m["seq_len"] * m["n_heads"] * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"] + m["v_head_dim"])
    return {"params_total": total, "params_embedding": embed, "params_active_per_token": int(active), "attention_term": attention,
            "flops_per_token": 6 * int(active) + attention,
            "convention": "6 x active parameters per token (routed experts at top_k / n_experts, input embedding excluded) "
                          "+ 6 x n_layers x seq_len x n_heads x (qk_nope + qk_rope + v head dims), causal mask not discounted"}


def part_speed(rec: Record, ctx: Ctx) -> None:
    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    memory = 80 * 2**30
    if reason is None:
        from portapipe.backends import get_backend

        memory = int(get_backend("cuda").describe()["memory_bytes"])
    budget = 0.85 * memory  # what the model may plan for: the allocator's caching and fragmentation take the rest
    sizing = []
    for model in SPEED_MODELS:
        need = memory_need(speed_raw(model, "cuda", False))
        sizing.append({"model": model, "planned_bytes": need["total"], "fits": need["total"] <= budget, "parts": need})
    rec.put("sizing", {"device_memory_bytes": memory, "budget_bytes": budget, "candidates": sizing, "common": SPEED_COMMON})
    chosen = [s["model"] for s in sizing if s["fits"]] or [SPEED_MODELS[-1]]
    if ctx.dry:
        chosen = chosen[:1]
    for model in chosen:
        raw = speed_raw(model, device, ctx.dry)
        flops = flops_per_token(raw)
        rec.put("flops", flops)
        ours = ours_speed(raw, ctx)
        rec.put("portapipe", ours)
        if "error" in ours and "out of memory" in ours["error"].lower():
            rec.setdefault("oom", []).append(model)
            continue
        break
    theirs = hf_speed(raw, ctx)
    rec.put("transformers", theirs)
    tokens = raw["train"]["micro_batch_size"] * raw["schedule"]["microbatches"] * raw["model"]["seq_len"]
    res: dict[str, Any] = {"model": raw["model"], "micro_batch_size": raw["train"]["micro_batch_size"],
                           "microbatches": raw["schedule"]["microbatches"], "tokens_per_step": tokens, "pp": 1, "ep": 1,
                           "precision": f"{raw['model']['dtype']} weights, {raw['train']['master_dtype']} master weights and AdamW",
                           "peak_tflops": PEAK_BF16_TFLOPS}
    if ours.get("tokens_per_s"):
        res["mfu"] = ours["tokens_per_s"] * flops["flops_per_token"] / (PEAK_BF16_TFLOPS * 1e12)
    if ours.get("tokens_per_s") and theirs.get("tokens_per_s"):
        res["ours_over_transformers"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    rec.put("result", res)
    rec["summary"] = (f"{ours.get('tokens_per_s') or 0:.0f} tok/s, MFU {100 * res.get('mfu', 0):.1f}%, "
                      f"{res.get('ours_over_transformers') or 0:.2f}x transformers ({theirs.get('experts_implementation')})")
    failed = "error" in ours or "error" in theirs
    rec["status"] = "failed" if failed else ("ok" if device == "cuda" else "dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"


def speed_rank(backend: Any, raw: dict[str, Any], deadline: float) -> dict[str, Any]:
    """portapipe's training step on this rank (the loop of portapipe train without its run folder
    and checkpoints: a 3-billion-parameter model's would be tens of GB): the pipelined step, then
    the sharded AdamW on float32 master weights; device time per step by the backend's timer."""
    import torch

    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.train import make_sharded_optimizer

    config = config_from_dict(raw)
    p, m, t = config.parallel, config.model, config.train
    backend.manual_seed(t.seed)
    rt = PipelineRuntime(config, backend, backend.parallel_groups(p.pp, p.dp, p.ep))
    opt = make_sharded_optimizer(rt, config, backend)
    opt.lr = t.lr
    g = torch.Generator().manual_seed(t.seed)
    tok = torch.randint(0, m.vocab_size, (config.schedule.microbatches, t.micro_batch_size, m.seq_len + 1), generator=g)
    mbs = [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in tok]
    backend.reset_peak_memory_stats()
    times, tokens = [], 0
    for step in range(t.steps):
        with backend.timed() as timer:
            result = rt.step(mbs)
            with torch.no_grad():
                opt.step(1.0)
            rt.grads.zero_grad()
        tokens = int(result.tokens)
        if step >= t.warmup_steps:
            times.append(timer.elapsed_s)
        if time.time() > deadline:
            break
    return {"tokens_per_step": tokens, "step_s": times, "allocator_peak_bytes": backend.max_memory_allocated(),
            "loss_last": float(result.loss)}


def ours_speed(raw: dict[str, Any], ctx: Ctx) -> dict[str, Any]:
    from portapipe.launch import run_ranks

    try:
        got = run_ranks(speed_rank, 1, raw, time.time() + ctx.left(40), backend=raw["backend"], wall_timeout_s=ctx.left(20))[0]
    except Exception as exc:
        return {"error": " ".join(str(exc).split())[:600]}
    rate = got["tokens_per_step"] / statistics.median(got["step_s"]) if got["step_s"] else None
    return {"tokens_per_s": rate, "steps_timed": len(got["step_s"]), **got}


def hf_speed(raw: dict[str, Any], ctx: Ctx) -> dict[str, Any]:
    """transformers' model, float32 weights under bfloat16 autocast (float32 master, as ours),
    the same batch shape, AdamW; the median tokens/s of the timed steps."""
    import torch

    from portapipe.backends import get_backend

    be = get_backend(raw["backend"])
    try:
        model, impl, tried = hf_model(raw, be.device())
        model = model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=raw["backend"] != "cpu")  # torch's fastest AdamW on a GPU
        m, t = raw["model"], raw["train"]
        mbs, n_mb = t["micro_batch_size"], raw["schedule"]["microbatches"]
        tokens = torch.randint(0, m["vocab_size"], (n_mb, mbs, m["seq_len"] + 1), device=be.device())
        autocast = torch.autocast(be.device().type, dtype=torch.bfloat16, enabled=raw["backend"] != "cpu")
        times = []

        def step_once() -> None:
            for i in range(n_mb):
                with autocast:
                    # transformers shifts the labels itself: the same tokens, predicting each next one
                    loss = model(input_ids=tokens[i, :, :-1], labels=tokens[i, :, :-1]).loss / n_mb
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        order = ["grouped_mm", "batched_mm", "eager"]
        while True:  # an implementation that builds may still refuse to run (dtype, device): the next one then
            try:
                step_once()
                break
            except Exception as exc:
                later = order[order.index(impl) + 1:] if impl in order else []
                if not later or not hasattr(model, "set_experts_implementation"):
                    raise
                tried.append(f"{impl} failed at its first step ({type(exc).__name__}: {str(exc)[:120]})")
                opt.zero_grad(set_to_none=True)
                impl = later[0]
                model.set_experts_implementation(impl)
        for step in range(t["steps"]):
            with be.timed() as timer:
                step_once()
            if step >= t["warmup_steps"]:
                times.append(timer.elapsed_s)
            if time.time() > ctx.deadline - 10:
                break
        rate = n_mb * mbs * m["seq_len"] / statistics.median(times) if times else None
        return {"tokens_per_s": rate, "experts_implementation": impl, "tried": tried, "steps_timed": len(times),
                "config_experts_implementation": str(getattr(model.config, "_experts_implementation", None)),
                "transformers": __import__("transformers").__version__,
                "precision": "float32 weights and AdamW, bfloat16 autocast" if raw["backend"] != "cpu" else "float32"}
    except Exception as exc:
        return {"error": tail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), 6)}


# --------------------------------------------------------------------- f grouped matmul
def part_grouped_mm(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends import get_backend

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    be = get_backend(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    e_model = speed_raw(SPEED_MODELS[0], "cuda", False)["model"]
    shapes = [(7168, 2048, "DeepSeek-V3"), (e_model["hidden"], e_model["moe_hidden"], "part e's model"), (2048, 768, "published anchor")]
    per_expert = (256, 1024, 4096) if not ctx.dry else (8, 16)
    groups = 8 if not ctx.dry else 2
    reps = 10 if not ctx.dry else 2
    rows = []
    for k, n, label in shapes:
        for t in per_expert + ((2048,) if label == "published anchor" and not ctx.dry else ()):
            if ctx.dry:
                k, n = 32, 16
            rows.append(_gmm_row(be, dtype, groups, t, k, n, label, reps))
            rec.put("rows", rows)
            if time.time() > ctx.deadline - 5:
                break
    rec["summary"] = "; ".join(f"{r['label']} {r['tokens_per_expert']}/e: {r['grouped_tflops']:.0f} vs dense {r['dense_tflops']:.0f} TFLOP/s"
                               for r in rows if r["tokens_per_expert"] in (1024, 2048) or ctx.dry)[:300]
    rec["status"] = "ok" if device == "cuda" else ("dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"


def _gmm_row(be: Any, dtype: Any, groups: int, t: int, k: int, n: int, label: str, reps: int) -> dict[str, Any]:
    """Forward + backward of ``groups`` experts of [k, n] on ``t`` rows each, grouped and dense (one
    [groups*t, k] x [k, n] matmul: the same FLOPs), TFLOP/s by the device's timer."""
    import torch

    dev = be.device()
    rows = groups * t
    a = torch.randn(rows, k, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(groups, k, n, device=dev, dtype=dtype, requires_grad=True)
    dense_w = torch.randn(k, n, device=dev, dtype=dtype, requires_grad=True)
    offs = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * t
    grad = torch.randn(rows, n, device=dev, dtype=dtype)

    def timed(fn: Callable[[], None]) -> float:
        fn()
        be.synchronize()
        times = []
        for _ in range(reps):
            with be.timed() as timer:
                fn()
            times.append(timer.elapsed_s)
        return statistics.median(times)

    def grouped() -> None:
        be.grouped_mm(a, w, offs).backward(grad)

    def dense() -> None:
        (a @ dense_w).backward(grad)

    flops = 6.0 * rows * k * n  # forward 2 x rows x k x n, backward twice that (input and weight gradients)
    g_s, d_s = timed(grouped), timed(dense)
    return {"label": label, "tokens_per_expert": t, "groups": groups, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."),
            "fused": bool(getattr(be, "grouped_mm_fused", lambda *_: False)(a, w)),
            "grouped_s": g_s, "dense_s": d_s, "grouped_tflops": flops / g_s / 1e12, "dense_tflops": flops / d_s / 1e12,
            "grouped_over_dense": d_s / g_s}


# ---------------------------------------------------------------------------- g memory
MEMORY_OPTIONS = {"off": {}, "level0": {"zero_memory": "level0"}, "level1": {"zero_memory": "level1"}, "recompute_moe": {"recompute": "moe"}}


def memory_raw(device: str, dry: bool, option: dict[str, Any]) -> dict[str, Any]:
    model = ({"hidden": 32, "n_layers": 2, "n_heads": 2, "ffn_hidden": 64, "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 16}
             if dry else {"hidden": 1024, "n_layers": 4, "n_heads": 8, "ffn_hidden": 4096, "moe_hidden": 512, "n_experts": 16, "top_k": 4, "seq_len": 1024})
    return {"backend": device, "parallel": {"pp": 1, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
            "model": {**model, "n_dense": 1, "n_shared": 1, "dtype": "float32", "vocab_size": 256},
            "memory": option, "train": {"micro_batch_size": 2 if dry else 4}}


def memory_rank(backend: Any, raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One step of each option on this rank: the allocator's peak and what the accounting saw."""
    import torch

    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.memory.accounting import SavedActivations

    out = {}
    for name, raw in raws.items():
        config = config_from_dict(raw)
        p = config.parallel
        be = type(backend)(backend.options)
        rt = PipelineRuntime(config, be, be.parallel_groups(p.pp, p.dp, p.ep))
        m = raw["model"]
        g = torch.Generator().manual_seed(0)
        mbs = []
        for _ in range(rt.schedule.n_microbatches):
            tok = torch.randint(0, m["vocab_size"], (raw["train"]["micro_batch_size"], m["seq_len"] + 1), generator=g)
            mbs.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
        rt.step(mbs)  # the gradients exist from here on, as in training
        be.synchronize()
        be.reset_peak_memory_stats()
        before = be.memory_allocated()
        tracker = SavedActivations(ignore=rt.parameters())
        with tracker.track():
            rt.step(mbs)
        be.synchronize()
        out[name] = {"allocator_before": before, "allocator_peak": be.max_memory_allocated(), "accounting_peak_saved": tracker.peak_bytes}
        del rt
        with contextlib.suppress(Exception):
            be.device_module().empty_cache()
    return out


def part_memory(rec: Record, ctx: Ctx) -> None:
    from portapipe.launch import run_ranks

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    raws = {name: memory_raw(device, ctx.dry, opt) for name, opt in MEMORY_OPTIONS.items()}
    model = {name: memory_need(raw) for name, raw in raws.items()}
    rec.put("model", model)
    if device == "cpu":  # the GPU run's shapes, through the same rules and memory model
        rec.put("gpu_model", {name: memory_need(memory_raw("cuda", False, opt)) for name, opt in MEMORY_OPTIONS.items()})
    measured = run_ranks(memory_rank, 1, raws, backend=device, wall_timeout_s=ctx.left())[0]
    rows = {}
    off = measured["off"]
    for name in raws:
        got, want = measured[name], model[name]
        predicted = want["params"] + want["grads"] + want["buffers"] + want["held_peak"]  # no optimizer in a bare step
        rows[name] = {**got, "model_step_peak": predicted, "model_saved_peak": want["saved_peak"],
                      "peak_vs_model": got["allocator_peak"] / predicted - 1 if got["allocator_peak"] else None,
                      "saved_vs_off_allocator": (off["allocator_peak"] or 0) - (got["allocator_peak"] or 0),
                      "saved_vs_off_model": model["off"]["held_peak"] - want["held_peak"],
                      "saved_vs_off_accounting": off["accounting_peak_saved"] - got["accounting_peak_saved"]}
    rec.put("rows", rows)
    rec.put("compared", "allocator peak of one step (forward + backward, gradients held, no optimizer) against the memory model's "
                        "params + grads + buffers + held_peak; savings: the off option's figure minus the option's, on each side")
    within = [abs(r["peak_vs_model"]) <= 0.05 for r in rows.values() if r["peak_vs_model"] is not None]
    rec["summary"] = ", ".join(f"{n}: peak {r['peak_vs_model']:+.1%} vs model" if r["peak_vs_model"] is not None else n for n, r in rows.items())
    if device == "cuda":
        rec["status"] = "ok" if within and all(within) else "failed"
    else:
        rec.update(status="dry" if ctx.dry else "skipped", reason=reason or "dry mode: the cpu backend has no allocator figures (its peak is the process's)")


# ------------------------------------------------------------------------------ h LPLB
def part_lplb(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends import get_backend
    from portapipe.balancing.lplb import Planner
    from portapipe.balancing.topology import cube

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    ep, experts, top_k = 8, 64, 8
    tokens = 4096 if not ctx.dry else 256
    r2o = cube()
    classes = int(r2o.shape[1])
    physical = experts + classes * ep
    g = torch.Generator().manual_seed(7)
    idx = torch.multinomial(torch.softmax(torch.randn(experts, generator=g) * 2, 0).expand(tokens, experts), top_k, generator=g).int()
    workload = torch.bincount(idx.flatten().long(), minlength=experts)
    cpu = Planner(r2o, physical, experts, ep_size=ep, use_triton=False)
    cpu.update_placement(workload)
    want = cpu.run(idx)
    rec.put("problem", {"ep": ep, "experts": experts, "physical": physical, "topology": "cube", "tokens": tokens, "top_k": top_k})
    be = get_backend(device)
    from portapipe.balancing import lplb_triton

    why = lplb_triton.why_unavailable(be.device())
    rec.put("triton", why or "available")
    dev = Planner(r2o, physical, experts, ep_size=ep, use_triton=not why)
    dev.update_placement(workload)  # the placement is planned from recorded loads, as in training
    on_device = idx.to(be.device())
    got = dev.run(on_device)  # the first call compiles the kernels
    equal = bool(torch.equal(got.cpu(), want))
    times = []
    for _ in range(3 if ctx.dry else 50):
        with be.timed() as timer:
            dev.run(on_device)
        times.append(timer.elapsed_s)
    us = statistics.median(times[1:] if len(times) > 1 else times) * 1e6
    rec.put("result", {"equal_to_cpu_path": equal, "paths": dev._paths_on.get(be.device()) if hasattr(dev, "_paths_on") else None,
                       "layer_us_median": us, "published_us": 100})
    rec["summary"] = f"{'equal' if equal else 'DIFFERS'} to the CPU path; {us:.0f} us per layer ({'triton' if not why else 'torch'})"
    if not equal:
        rec["status"] = "failed"
    elif device == "cuda" and not why:
        rec["status"] = "ok"
    else:
        rec.update(status="dry" if ctx.dry else "skipped", reason=reason or why or "dry mode")


# ----------------------------------------------------------------------- i step claims
def part_step_claims(rec: Record, ctx: Ctx) -> None:
    if CHECKOUT is None:
        rec.update(status="skipped", summary="needs a source checkout (balance_e2e reads examples/expert_loads.txt)")
        return
    from portapipe.train import rank_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rec.put("cores", {"usable": cores, "threads_per_rank_4": rank_threads(4), "threads_per_rank_8": rank_threads(8),
                      "pinning": "none: the launcher has no per-rank core option; each rank runs rank_threads() = cores // ranks "
                                 "intra-op threads, so ranks x threads <= cores; the operating system places them"})
    bench = CHECKOUT / "benchmarks"
    runs = {
        "step_vs_torch": [sys.executable, str(bench / "step_vs_torch.py"), "--steps", "8", "--warmup", "2"],
        "balance_e2e": [sys.executable, str(bench / "balance_e2e.py"), "--layouts", "ep4", "pp2ep4", "--sources", "loads", "uniform",
                        "--steps", "6", "--warmup", "2"],
    }
    if ctx.dry or cores < 8:  # the flags still have to be the benchmarks' own: --help lists them
        for name, cmd in runs.items():
            res = run_cmd([cmd[0], cmd[1], "--help"], ctx.left())
            flags = [c for c in cmd[2:] if c.startswith("--")]
            missing = [f for f in flags if f not in res["stdout"]]
            rec.put(name, {"command": " ".join(cmd[1:]), "help_rc": res["rc"], "flags_missing": missing})
            if res["rc"] != 0 or missing:
                rec.update(status="failed", summary=f"{name}: {missing or tail(res['stderr'], 3)}")
                return
        rec.update(status="dry" if ctx.dry else "skipped", reason="dry mode" if ctx.dry else f"{cores} cores: the claims need one core set per rank (8 or more)",
                   summary="commands checked against the benchmarks' --help")
        return
    bad = 0
    for name, cmd in runs.items():
        say(f"  i: {name}")
        res = run_cmd(cmd, ctx.left() * (0.55 if name == "step_vs_torch" else 1.0), cwd=CHECKOUT)
        try:
            rec.put(name, {"command": " ".join(cmd[1:]), "s": res["s"], "result": last_json(res["stdout"])})
        except ValueError:
            bad += 1
            rec.put(name, {"command": " ".join(cmd[1:]), "rc": res["rc"], "timed_out": res["timed_out"], "error": tail(res["stderr"], 8)})
    r = rec["results"]
    ratios = {s: v.get("ours_over_torch") for s, v in r.get("step_vs_torch", {}).get("result", {}).get("schedules", {}).items()} if "result" in r.get("step_vs_torch", {}) else {}
    rec["summary"] = f"ours/torch step: {ratios}" if ratios else "see the JSON"
    rec["status"] = "failed" if bad else "ok"


PARTS = [
    Part("a", "environment", part_env, 30, 60),
    Part("b", "the suite, cuda tests, conformance kit", part_suite, 270, 120),
    Part("c", "verify: every schedule on the GPU", part_verify, 90, 120),
    Part("d", "portability CPU <-> CUDA, bf16 vs float32", part_portability, 100, 180),
    Part("e", "speed: tokens/s, MFU, vs transformers", part_speed, 100, 120),
    Part("f", "grouped matmul vs dense", part_grouped_mm, 25, 60),
    Part("g", "allocator peak vs memory model", part_memory, 25, 90),
    Part("h", "LPLB Triton kernels", part_lplb, 15, 60),
    Part("i", "step_vs_torch, balance_e2e, a core set per rank", part_step_claims, 60, 60),
]
BY_KEY = {p.key: p for p in PARTS}


# --------------------------------------------------------------------------- the driver
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
        if cap < 10:
            report["parts"][key].update(status="not run", reason=f"the budget of {budget_s:.0f} s is spent")
            say(f"{key}: not run, the budget is spent")
            write(out, report)
            continue
        say(f"{key}: {part.title} (cap {cap:.0f} s)")
        path = out / "parts" / f"{key}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--out", str(out), "--cap-s", str(cap)] + (["--dry"] if dry else [])
        res = run_cmd(cmd, cap + 10, child_env({"TRITON_INTERPRET": "1"} if dry and key == "h" else None))
        rec = json.loads(path.read_text()) if path.exists() else {"part": key, "title": part.title, "results": {}}
        if res["timed_out"]:
            rec.update(status="timeout", error=f"stopped at its cap of {cap:.0f} s; what it finished is kept")
        elif res["rc"] != 0 or rec.get("status") in (None, "running"):
            rec.update(status="crashed", error=f"exit code {res['rc']}: " + tail(res["stderr"], 12))
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
    report = drive(keys, out, args.dry, args.budget_s)
    print(table(report), flush=True)
    bad = [k for k, r in report["parts"].items() if r["status"] in ("failed", "crashed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
