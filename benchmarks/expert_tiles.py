"""The routed experts on one EP rank's received rows: three ways to lay out a grouped matmul.

The rows a rank receives come grouped by (source rank, local expert), source-major. Three ways
to run the expert MLP (gate/up grouped linear, SwiGLU scaled by the router weight, down grouped
linear) over them, forward and backward, timed in turn in one process:

- ``per_tile`` (portapipe): one grouped matmul per source over the expert weights themselves;
  each (source, expert) group meets the same rows and weights as in one call;
- ``tiled_copy``: one grouped matmul over the weights repeated once per source (portapipe's
  previous way; the copy holds ep - 1 times the rank's expert weights, and the weight gradient
  is ep - 1 times larger before its sum);
- ``expert_major``: the rows permuted so each expert's rows from every source are contiguous,
  one grouped matmul, the outputs permuted back (the layout of grouped-GEMM MoE layers that sort
  tokens by expert; its groups differ from ours, so its results are not bit-equal to ours).

Reported per EP size: median processor milliseconds of a forward and backward (one thread), and
the bytes of weight copies each makes in a forward of both linears (from the shapes; the
backward's weight gradient before the sum is as large again).

    python benchmarks/expert_tiles.py [--ep 4,8,16] [--rows-per-source 256] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.config import ModelConfig
from portapipe.models.functions import swiglu
from portapipe.models.linear import grouped_linear
from portapipe.models.ffn import Experts

# balance_e2e's expert shape
MODEL = {"arch": "qwen3_moe", "hidden": 64, "moe_hidden": 1024, "n_experts": 12, "n_shared": 0, "top_k": 4, "n_heads": 2}


def _variants(experts: Experts, counts: torch.Tensor, backend: CPUBackend) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    sources, slots = counts.shape
    offs = torch.cumsum(counts.reshape(-1), 0)
    tile_rows = counts.sum(1).tolist()
    # expert-major: rows of expert e from every source together, in source order
    group_of_row = torch.arange(sources * slots).repeat_interleave(counts.reshape(-1))
    expert_major = torch.argsort(group_of_row % slots, stable=True)
    back = torch.argsort(expert_major)
    major_offs = torch.cumsum(counts.sum(0), 0)
    width = experts.width

    def per_tile(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return experts(x, w, offs, backend, tile_rows)

    def tiled_copy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gu = backend_linear(x, experts.gate_up.repeat(sources, 1, 1), offs)
        return backend_linear(swiglu(gu, width, w).contiguous(), experts.down.repeat(sources, 1, 1), offs)

    def by_expert(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xs, ws = x.index_select(0, expert_major), w.index_select(0, expert_major)
        gu = backend_linear(xs, experts.gate_up, major_offs)
        return backend_linear(swiglu(gu, width, ws).contiguous(), experts.down, major_offs).index_select(0, back)

    def backend_linear(x: torch.Tensor, weight: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, weight, o, backend)

    return {"per_tile": per_tile, "tiled_copy": tiled_copy, "expert_major": by_expert}


def measure(ep: int, rows_per_source: int, reps: int, slots: int = 4) -> dict[str, object]:
    cfg = ModelConfig(**MODEL)
    experts = Experts(cfg, slots, slots, torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    sources = ep - 1
    counts = torch.full((sources, slots), rows_per_source // slots)
    n = int(counts.sum())
    x, w, gy = torch.randn(n, cfg.hidden, generator=g), torch.rand(n, generator=g), torch.randn(n, cfg.hidden, generator=g)
    variants = _variants(experts, counts, CPUBackend())
    times: dict[str, list[float]] = {k: [] for k in variants}
    outputs: dict[str, torch.Tensor] = {}
    for r in range(reps + 2):
        for name, fn in variants.items():  # in turn, so load changes hit all three alike
            leaf = x.clone().requires_grad_()
            t0 = time.process_time()
            out = fn(leaf, w)
            out.backward(gy)
            t1 = time.process_time()
            experts.zero_grad(set_to_none=True)
            if r >= 2:
                times[name].append(t1 - t0)
            outputs[name] = out.detach()
    weight_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    return {
        "ep": ep,
        "rows": n,
        "median_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()},
        "per_tile_over_tiled_copy": round(statistics.median(times["per_tile"]) / statistics.median(times["tiled_copy"]), 3),
        "per_tile_over_expert_major": round(statistics.median(times["per_tile"]) / statistics.median(times["expert_major"]), 3),
        "weight_copy_bytes": {"per_tile": 0, "tiled_copy": sources * weight_bytes, "expert_major": 0},
        "per_tile_equals_tiled_copy": bool(torch.equal(outputs["per_tile"], outputs["tiled_copy"])),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", default="4,8,16", help="EP sizes: each rank receives from ep - 1 sources [4,8,16]")
    ap.add_argument("--rows-per-source", type=int, default=256, help="rows each source sends this rank [256]")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per variant [30]")
    args = ap.parse_args(argv)
    try:
        eps = [int(e) for e in args.ep.split(",")]
    except ValueError:
        ap.error(f"--ep must be comma-separated integers, got {args.ep!r}")
    if any(e < 2 for e in eps) or args.rows_per_source < 4 or args.reps < 1:
        ap.error("--ep values must be >= 2, --rows-per-source >= 4 and --reps >= 1")
    torch.set_num_threads(1)
    result = {
        "benchmark": "expert_tiles",
        "machine": {"processor": platform.machine(), "torch": torch.__version__, "threads": 1},
        "runs": [measure(e, args.rows_per_source, args.reps) for e in eps],
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
