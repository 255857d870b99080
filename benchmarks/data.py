"""The data path's figures: tokenizing against Hugging Face datasets, batch making against a step,
a 20 GB corpus against a 20 MB one, blend shares and epochs, and what document masking costs.

1. Tokenize: one jsonl (Shakespeare's paragraphs, one per line, repeated to at least ``--mb`` MB) encoded
   with the shipped tokenizer's ``tokenizer.json`` by ``portapipe tokenize`` (``write_dataset``) and by the
   peer, ``datasets.load_dataset("json")`` then ``.map(encode_batch_fast, batched=True, num_proc=N)``,
   at N = 1 and 2 workers. Each side runs in a fresh process per round, timed from the call to the end
   of its output on disk, imports apart: ours reads the jsonl, encodes it and writes the dataset folder
   (tokens, document index, description, fsync'ed); the peer reads the jsonl into its arrow cache, encodes
   it and writes the mapped dataset's arrow files (cache emptied before each round). Both encode
   ``add_special_tokens=False`` with the tokenizers library's thread pool off (``TOKENIZERS_PARALLELISM=false``,
   which portapipe sets in its workers itself), so each side keeps N cores busy. The sides alternate over
   ``--rounds`` rounds (the order swapped each round) so a load from elsewhere hits both alike; MB/s of the
   jsonl, min and median over the rounds, ours over theirs by the best and by the median round. With one
   worker each side encodes in the process timed, so its processor seconds over the same stretch are given
   too (ours includes loading the tokenizer, the peer's is loaded before): on a loaded machine the wall clock
   says how the scheduler shared the cores, the processor time how much work each side did.
2. Batch making: one rank's share of a step's batch of examples/deepseek_v3.yaml (epochs, with the
   document mask), timed over ``--batches`` steps, against the median step of a training run of
   that config on the tokenized jsonl in the same process tree.
3. A 20 GB corpus (``--big-gb``; a sparse tokens file, documents of 4,096 tokens) against a 20 MB
   one: the seconds to check and open it and to the first batch, and how the resident memory grew
   over ``--batches`` steps' batches (anonymous memory, and the file's pages mapped in, which the
   kernel may drop), each in a fresh process. The files are deleted afterwards.
4. Blends: three sources at 0.5 / 0.3 / 0.2, each source's share over 1,000-step stretches (the
   largest distance from its weight), and each one's epoch after 1,000 steps.
5. Document masking: the median step of the deepseek_v3 run with ``data.document_mask`` on over off.

Prints one JSON object.

    python benchmarks/data.py [--mb 8] [--rounds 5] [--steps 12] [--batches 200] [--big-gb 20] [--only tokenize]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deepseek_v3.yaml"
TOKENIZER = ROOT / "examples" / "tokenizer"


def make_jsonl(path: Path, mb: float) -> int:
    from portapipe.data.shipped import DEFAULT_CORPUS

    paragraphs = [p for p in gzip.decompress(DEFAULT_CORPUS.read_bytes()).decode().split("\n\n") if p.strip()]
    lines = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
    with open(path, "w") as f:
        for _ in range(max(1, -(-int(mb * 1e6) // len(lines)))):  # at least mb MB
            f.write(lines)
    return path.stat().st_size


def ours(jsonl: Path, out: Path, workers: int) -> tuple[float, float]:
    from portapipe.data.readers import expand
    from portapipe.data.shipped import shipped_eos
    from portapipe.data.tokenizer import load_tokenizer
    from portapipe.data.writer import Options, write_dataset

    eos = shipped_eos(load_tokenizer(TOKENIZER))

    shutil.rmtree(out, ignore_errors=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    write_dataset(expand([str(jsonl)]), out, Options(TOKENIZER, eos=eos, workers=workers))
    return time.perf_counter() - t0, time.process_time() - cpu0


def theirs(jsonl: Path, cache: Path, workers: int) -> tuple[float, float]:
    """datasets: the jsonl loaded (arrow cache written) and mapped in batches, as its docs show."""
    import datasets
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    datasets.disable_progress_bars()

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

    shutil.rmtree(cache, ignore_errors=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    ds = datasets.load_dataset("json", data_files=str(jsonl), split="train", cache_dir=str(cache))
    ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    return time.perf_counter() - t0, time.process_time() - cpu0


def one_side(side: str, jsonl: Path, out: Path, workers: int) -> tuple[float, float]:
    """One round of one side in a fresh process (its imports apart from the time): (seconds, the
    processor seconds of that process, all its threads; with one worker both sides encode in it)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, str(jsonl), str(out), str(workers)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    wall, cpu = done.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def tokenize_rounds(jsonl: Path, tmp: Path, rounds: int) -> dict[str, Any]:
    """Both sides at 1 and 2 workers, alternating (see the module docstring)."""
    size = jsonl.stat().st_size
    got: dict[str, Any] = {"jsonl_bytes": size, "rounds": rounds}
    for n in (1, 2):
        times: dict[str, list[float]] = {"ours": [], "datasets": []}
        cpu: dict[str, list[float]] = {"ours": [], "datasets": []}
        for r in range(rounds):
            for side in ("ours", "datasets") if r % 2 == 0 else ("datasets", "ours"):
                wall, used = one_side(side, jsonl, tmp / f"{side}{n}", n)
                times[side].append(wall)
                cpu[side].append(used)
        mb_s = {side: sorted(size / 1e6 / t for t in ts) for side, ts in times.items()}
        got[f"workers_{n}"] = {
            "ours_mb_s": {"best": mb_s["ours"][-1], "median": statistics.median(mb_s["ours"])},
            "datasets_map_mb_s": {"best": mb_s["datasets"][-1], "median": statistics.median(mb_s["datasets"])},
            "ours_over_datasets_best": mb_s["ours"][-1] / mb_s["datasets"][-1],
            "ours_over_datasets_median": statistics.median(mb_s["ours"]) / statistics.median(mb_s["datasets"]),
            "seconds": times,
        }
        if n == 1:  # every encoding thread in the timed process: processor time, which a load from elsewhere barely moves
            got["workers_1"]["processor_s"] = cpu
            got["workers_1"]["ours_over_datasets_processor_median"] = statistics.median(cpu["datasets"]) / statistics.median(cpu["ours"])
    return got


def train(folder: Path, data_path: Path, steps: int, mask: bool) -> dict[str, Any]:
    log = folder / f"run-{'mask' if mask else 'plain'}"
    cmd = [sys.executable, "-m", "portapipe.cli", "train", str(EXAMPLE), "--set", f"data.path={data_path}", "--set", f"train.steps={steps}",
           "--set", f"log.dir={log}", "--set", "log.progress=false", "--set", "checkpoint.every=0", "--set", "checkpoint.at_end=false",
           "--set", f"data.document_mask={'true' if mask else 'false'}"]
    subprocess.run(cmd, check=True, capture_output=True)
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["iter_s"] for r in rows if r.get("kind") == "train"][1:]
    return {"median_step_s": statistics.median(steps_s), "steps": len(steps_s) + 1}


def batch_time(data_path: Path, batches: int) -> float:
    from portapipe.config import load_config
    from portapipe.data.batches import Batches

    c = load_config(EXAMPLE, [f"data.path={data_path}", "data.document_mask=true"])
    data = Batches(c)
    replicas = c.parallel.dp * c.parallel.ep
    t0 = time.perf_counter()
    for step in range(batches):
        data.microbatches(step, 0, replicas, c.schedule.microbatches, c.train.micro_batch_size, c.model.seq_len)
    return (time.perf_counter() - t0) / batches


_PROBE = r"""
import json, sys, time
from portapipe.config import load_config
from portapipe.data.batches import Batches
from portapipe.data.corpus import data_problems
def rss():  # anonymous memory (the process's own), and file pages mapped in (the kernel's cache, reclaimable)
    got = {}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon:", "RssFile:")):
            got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got
c = load_config(sys.argv[1], [f"data.path={sys.argv[2]}", "data.document_mask=true", "data.val_fraction=0.01"])
before = rss()
t0 = time.perf_counter()
assert data_problems(c) == []  # what the launch checks
data = Batches(c)
opened = time.perf_counter() - t0
replicas = c.parallel.dp * c.parallel.ep
data.microbatches(0, 0, replicas, c.schedule.microbatches, c.train.micro_batch_size, c.model.seq_len)
first = time.perf_counter() - t0
for step in range(1, int(sys.argv[3])):
    data.microbatches(step * 7919, 0, replicas, c.schedule.microbatches, c.train.micro_batch_size, c.model.seq_len)
after = rss()
print(json.dumps({"check_and_open_s": opened, "to_first_batch_s": first, "rss_anon_growth_bytes": after["RssAnon"] - before["RssAnon"],
                  "rss_file_growth_bytes": after["RssFile"] - before["RssFile"], "tokens": data.n_tokens("train")}))
"""


def synthetic(folder: Path, n_bytes: int) -> Path:
    """A dataset folder of ``n_bytes`` of uint16 tokens (a sparse file: zeros cost no disk), documents of 4,096 tokens."""
    import numpy as np

    folder.mkdir(parents=True)
    tokens = n_bytes // 2
    with open(folder / "tokens.bin", "wb") as f:
        f.truncate(tokens * 2)
    np.append(np.arange(0, tokens, 4096, dtype="<i8"), tokens).astype("<i8").tofile(folder / "documents.bin")
    docs = (tokens + 4095) // 4096
    (folder / "dataset.json").write_text(json.dumps({"format": "portapipe.dataset", "version": 1, "dtype": "uint16", "vocab_size": 1024,
                                                    "eos_id": 0, "documents": docs, "tokens": tokens, "max_id": 0}))
    return folder


def probe(folder: Path, batches: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(EXAMPLE), str(folder), str(batches)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def blend_figures() -> dict[str, Any]:
    import numpy as np

    from portapipe.data.blend import Blend

    weights, gb, steps = [0.5, 0.3, 0.2], 8, 1000
    blend = Blend(weights)
    worst = 0.0
    for first in range(0, 100_000, 997):  # 1,000-step stretches starting anywhere in 100,000 steps
        source, _ = blend.assign(np.arange(first * gb, (first + steps) * gb))
        worst = max(worst, float(np.abs(np.bincount(source, minlength=3) / (steps * gb) - weights).max()))
    taken = blend.taken(steps * gb)
    return {"weights": weights, "global_batch": gb, "max_share_error_over_1000_steps": worst,
            "samples_after_1000_steps": taken.tolist(), "shares_after_1000_steps": (taken / (steps * gb)).tolist()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="size of the jsonl tokenized [8 MB]")
    ap.add_argument("--steps", type=int, default=12, help="training steps of each deepseek_v3 run [12]")
    ap.add_argument("--batches", type=int, default=200, help="steps' batches made when timing [200]")
    ap.add_argument("--big-gb", type=float, default=20.0, help="size of the big synthetic corpus [20 GB]")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of each tokenizer side [5]")
    ap.add_argument("--only", choices=("tokenize",), help="measure the tokenizers alone [everything]")
    ap.add_argument("--side", nargs=4, metavar=("SIDE", "JSONL", "OUT", "WORKERS"), help=argparse.SUPPRESS)  # one round, in its own process
    args = ap.parse_args(argv)
    if args.side:
        side, jsonl, dest, n = args.side
        print(*(ours if side == "ours" else theirs)(Path(jsonl), Path(dest), int(n)))
        return 0
    load_before = os.getloadavg()
    out: dict[str, Any] = {"benchmark": "data", "command": "python benchmarks/data.py " + " ".join(sys.argv[1:] if argv is None else argv),
                           "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
                           "load_average_before": load_before}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        jsonl = tmp / "plays.jsonl"
        make_jsonl(jsonl, args.mb)
        out["tokenize"] = tokenize_rounds(jsonl, tmp, args.rounds)
        if args.only == "tokenize":
            out["load_average_after"] = os.getloadavg()
            print(json.dumps(out, indent=1))
            return 0
        dataset = tmp / "ours1"
        plain, masked = train(tmp, dataset, args.steps, False), train(tmp, dataset, args.steps, True)
        per_batch = batch_time(dataset, args.batches)
        out["batch_making"] = {"per_step_batch_s": per_batch, "median_step_s": masked["median_step_s"],
                               "share_of_step": per_batch / masked["median_step_s"]}
        out["document_mask"] = {"median_step_s_off": plain["median_step_s"], "median_step_s_on": masked["median_step_s"],
                                "on_over_off": masked["median_step_s"] / plain["median_step_s"]}
    big_dir = Path(tempfile.mkdtemp(prefix="portapipe-data-bench-"))
    try:
        small = probe(synthetic(big_dir / "small", 20 * 10**6), args.batches)
        big = probe(synthetic(big_dir / "big", int(args.big_gb * 10**9)), args.batches)
    finally:
        shutil.rmtree(big_dir, ignore_errors=True)  # the disk is shared: nothing stays
    out["corpus_size"] = {"small_20mb": small, f"big_{args.big_gb:g}gb": big,
                          "open_big_over_small": big["check_and_open_s"] / small["check_and_open_s"],
                          "first_batch_big_over_small": big["to_first_batch_s"] / small["to_first_batch_s"]}
    out["blend"] = blend_figures()
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
