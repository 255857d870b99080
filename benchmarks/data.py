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
6. One long document: ``portapipe tokenize`` of a one-line jsonl of ``--long-mb`` MB (the plays'
   paragraphs joined into one text) with 1 and 2 workers, and of the same text as a plain text
   file with 1, each in a fresh process: the peak resident memory of the largest process (the
   command's own, exact; a worker's sampled every 20 ms), its seconds and the tokens written. A long document is encoded in slices
   of 64 Ki characters, so the peak stays a few times the text's size.
7. File checks: what checking a source's files against what they were when opened costs (two
   checks a batch, three stat calls each for a dataset folder, so a deleted, truncated, replaced or
   rewritten file stops the run in one line instead of a SIGBUS or other tokens): one rank's batch
   of examples/deepseek_v3.yaml on a 20 MB dataset folder over ``--batches`` steps, with the checks
   and without them (the best of three passes each), and one check alone (over 10,000), whose
   two a batch are its share.

Prints one JSON object.

    python benchmarks/data.py [--mb 8] [--rounds 5] [--steps 12] [--batches 200] [--big-gb 20] [--long-mb 50] [--only tokenize|long|checks]
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


def make_long(folder: Path, mb: float) -> tuple[Path, Path]:
    """(a one-line jsonl, a text file) holding one document of at least ``mb`` MB."""
    from portapipe.data.shipped import DEFAULT_CORPUS

    plays = gzip.decompress(DEFAULT_CORPUS.read_bytes()).decode()
    text = (plays + "\n") * max(1, -(-int(mb * 1e6) // (len(plays) + 1)))
    jsonl, plain = folder / "long.jsonl", folder / "long.txt"
    jsonl.write_text(json.dumps({"text": text}) + "\n")
    plain.write_text(text)
    return jsonl, plain


#: run a command and print its peak resident memory (KiB): itself, and the children it waited for
_PEAK = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); " \
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"


def _below(root: int) -> list[int]:
    """Every process below ``root`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        found.append(pid := todo.pop())
        todo += children.get(pid, [])
    return found


def _hwm(pid: int) -> int:
    """A process's peak resident memory so far (VmHWM, bytes), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss(cmd: list[str]) -> int:
    """The peak resident memory of the largest process ``cmd`` runs: the command's own, exact,
    and its workers' (children of a fork server it does not wait for) sampled every 20 ms."""
    wrapper = subprocess.Popen([sys.executable, "-c", _PEAK, *cmd], stdout=subprocess.PIPE, text=True)
    workers = 0
    while wrapper.poll() is None:
        workers = max([workers, *(_hwm(pid) for pid in _below(wrapper.pid))])
        time.sleep(0.02)
    out, _ = wrapper.communicate()
    if wrapper.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({wrapper.returncode})")
    return max(workers, int(out.split()[-1]) * 1024)


def long_document(folder: Path, mb: float) -> dict[str, Any]:
    """Peak memory and time of tokenizing one long document (see the module docstring)."""
    jsonl, plain = make_long(folder, mb)
    eos = "187"  # byte 0xff's token in the shipped tokenizer: the plays never hold it
    got: dict[str, Any] = {"document_bytes": plain.stat().st_size, "jsonl_bytes": jsonl.stat().st_size}
    for name, path, workers in (("jsonl_workers_1", jsonl, 1), ("jsonl_workers_2", jsonl, 2), ("text_workers_1", plain, 1)):
        out = folder / name
        cmd = [sys.executable, "-m", "portapipe.cli", "tokenize", str(path), str(out), "--tokenizer", str(TOKENIZER), "--eos", eos,
               "--workers", str(workers), "--no-progress"]
        t0 = time.perf_counter()
        peak = peak_rss(cmd)
        seconds = time.perf_counter() - t0
        meta = json.loads((out / "dataset.json").read_text())
        got[name] = {"peak_rss_bytes": peak, "peak_over_document": peak / got["document_bytes"], "seconds": seconds,
                     "documents": meta["documents"], "tokens": meta["tokens"]}
        shutil.rmtree(out)
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


def check_cost(folder: Path, batches: int) -> dict[str, Any]:
    """Seconds of one rank's batch with and without the file checks, and of one check (see the module docstring)."""
    from portapipe.config import load_config
    from portapipe.data.batches import Batches
    from portapipe.data.sources import Source

    c = load_config(EXAMPLE, [f"data.path={folder}", "data.document_mask=true", "data.val_fraction=0.01"])
    data = Batches(c)
    replicas = c.parallel.dp * c.parallel.ep
    shape = (replicas, c.schedule.microbatches, c.train.micro_batch_size, c.model.seq_len)

    def per_batch() -> float:
        best = float("inf")
        for _ in range(3):  # the best of three passes: a load from elsewhere only adds
            t0 = time.perf_counter()
            for step in range(batches):
                data.microbatches(step, 0, *shape)
            best = min(best, (time.perf_counter() - t0) / batches)
        return best

    checked = per_batch()
    real = Source.check
    Source.check = lambda self: None  # type: ignore[method-assign]
    try:
        unchecked = per_batch()
    finally:
        Source.check = real  # type: ignore[method-assign]
    source = data.corpus.train[0].source
    t0 = time.perf_counter()
    for _ in range(10_000):
        source.check()
    one = (time.perf_counter() - t0) / 10_000
    # two checks a batch (before and after its read): timed alone, as the batch's times differ by less than their noise
    return {"files_per_source": len(source.files), "one_check_s": one, "checks_per_batch_s": 2 * one,
            "per_batch_s_checked": checked, "per_batch_s_unchecked": unchecked, "checks_share_of_batch": 2 * one / checked}


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
    ap.add_argument("--long-mb", type=float, default=50.0, help="size of the one long document tokenized [50 MB]")
    ap.add_argument("--only", choices=("tokenize", "long", "checks"), help="measure the tokenizers, the long document or the file checks alone [everything]")
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
        if args.only in (None, "checks"):
            out["file_checks"] = check_cost(synthetic(tmp / "checked", 20 * 10**6), args.batches)
        if args.only == "checks":
            out["load_average_after"] = os.getloadavg()
            print(json.dumps(out, indent=1))
            return 0
        if args.only in (None, "long"):
            out["long_document"] = long_document(tmp, args.long_mb)
        if args.only == "long":
            out["load_average_after"] = os.getloadavg()
            print(json.dumps(out, indent=1))
            return 0
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
