"""The memory model against what is measured: each part's saved bytes equal the accounting's,
byte for byte; a schedule's per-rank peak equals the accounting's peak over a real step;
parameters, gradients and AdamW's state equal the tensors' sizes; DualPipe on the DeepSeek-V3
shape keeps two copies of the parameters and pp+1 micro-batches in flight."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.config import MemoryConfig, load_config
from portapipe.memory import accounting
from portapipe.memory.policy import configure
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.fp8_layers import enable_fp8
from portapipe.models.moe import build_blocks
from portapipe.models.objective import Objective
from portapipe.plan.measure_parts import PartBytes
from portapipe.plan.memory_model import MemoryModel, static_memory
from portapipe.config.setup import Setup
from portapipe.plan.fp8_bytes import saved_delta
from portapipe.plan.norm_recompute import dropped_bytes
from portapipe.plan.programs import stage_specs
from portapipe.plan.shape import Shape, held_bytes, saved_bytes
from portapipe.scheduling.executor import build_schedule
from portapipe.scheduling.overlap import Tape, observing, run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu.yaml"
#: the Hugging Face architectures' examples (deepseek_v3: multi-head latent attention; qwen3_moe:
#: grouped-query attention), on the corpus's bytes
DEEPSEEK, QWEN = ROOT / "examples" / "deepseek_v3.yaml", ROOT / "examples" / "qwen3_moe.yaml"
BYTES = ["data.format=bytes", "data.path=null"]
SMALL = ["parallel.pp=1", "parallel.ep=1", "schedule.name=1f1b", "train.micro_batch_size=2", "model.seq_len=16"]
OPTIONS = {"off": {}, "level0": {"zero_memory": "level0"}, "level1": {"zero_memory": "level1"},
           "recompute_moe": {"recompute": "moe"}, "recompute_full": {"recompute": "full"}}


def _forward(cfg, option: str, memory: dict[str, Any] | None = None, ep: int = 1):
    """One block of ``cfg`` under ``option`` (or the memory section ``memory``; with the config's
    FP8-cached activations), on one rank; ``ep`` 2: one process playing both EP ranks (every
    exchange delivers what was sent)."""
    from tests.test_overlap import _LoopbackBackend

    m = cfg.model
    blocks = build_blocks(m, [0], 1, ExpertParallel(CPUBackend()) if ep == 1 else ExpertParallel(_LoopbackBackend(), size=2, rank=1), 1,
                          Objective.from_train(cfg.train))
    if cfg.train.fp8 != "off":
        enable_fp8(blocks, CPUBackend(), cfg.memory.fp8_activations)
    configure(blocks, MemoryConfig(**(OPTIONS[option] if memory is None else memory)))
    block = blocks[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab_size, (cfg.train.micro_batch_size, m.seq_len), generator=g)
    return block, x, x.clone()


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize(
    "shape", [[], ["model.moe_hidden=24", "model.top_k=1", "model.n_shared=2"], ["model.dtype=float64", "model.hidden=48", "model.n_heads=3"], ["model.dtype=bfloat16"],
              ["model.mtp_layers=2"], ["model.dtype=float16"],  # float16: the norms keep float32 scales
              ["train.seq_aux_loss_weight=0.001", "model.mtp_layers=1"], ["train.seq_aux_loss_weight=0.001", "model.dtype=bfloat16"]]
)
def test_each_part_saves_what_the_formula_says(shape: list[str], option: str) -> None:
    """Per part call, the accounting's bytes equal shape.saved_bytes (attention also keeps the
    rotary tables, counted once per layer)."""
    _check_parts(EXAMPLE, shape, option)


HF_SHAPES = {
    "mla": (DEEPSEEK, []),
    "mla-bf16": (DEEPSEEK, ["model.dtype=bfloat16"]),
    "mla-mtp2": (DEEPSEEK, ["model.mtp_layers=2"]),
    "mla-full-rank-q-top1": (DEEPSEEK, ["model.q_lora_rank=0", "model.top_k=1", "model.n_shared=2", "model.norm_topk_prob=false"]),
    "mla-fused": (DEEPSEEK, ["model.qk_nope_head_dim=8"]),  # query / key width = value width: the fused kernel
    # train.fp8 (one EP rank: every row is the rank's own, kept in bfloat16)
    "mla-fp8": (DEEPSEEK, ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "train.fp8=deepseek"]),
    "gqa": (QWEN, []),
    "gqa-bf16-mha": (QWEN, ["model.dtype=bfloat16", "model.n_kv_heads=4"]),
    "gqa-one-kv-head": (QWEN, ["model.n_kv_heads=1", "model.norm_topk_prob=false"]),
    # the sequence-wise balance loss (its load fractions; the sigmoid router's affinity sums)
    "mla-bf16-seq-aux-mtp": (DEEPSEEK, ["model.dtype=bfloat16", "train.seq_aux_loss_weight=0.001", "model.mtp_layers=1"]),
    "gqa-seq-aux": (QWEN, ["train.seq_aux_loss_weight=0.001"]),
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list(HF_SHAPES))
def test_each_part_of_mla_and_gqa_saves_what_the_formula_says(name: str, option: str) -> None:
    """deepseek_v3's latent attention (low-rank query or not, torch's math attention on the CPU, the
    float32 router copies in bfloat16) and qwen3_moe's grouped-query attention, part by part."""
    example, shape = HF_SHAPES[name]
    _check_parts(example, BYTES + shape, option)


#: MLA in FP8 with FP8-cached activations (bfloat16, widths of 128 where the case needs them)
MLA_FP8 = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=128", "train.fp8=deepseek",
           "model.q_lora_rank=128", "model.kv_lora_rank=128", "model.qk_nope_head_dim=24", "model.qk_rope_head_dim=8", "model.v_head_dim=32"]
GQA_FP8 = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.head_dim=64", "train.fp8=deepseek"]
RECIPE_SHAPES = {
    **HF_SHAPES,
    # the fused kernel; q_b in FP8 (its input cached), kv_a (136 wide) and kv_b (224) not: the normed input stays
    "mla-fp8-qb": (DEEPSEEK, MLA_FP8),
    "mla-fp8-qb-mtp": (DEEPSEEK, MLA_FP8 + ["model.mtp_layers=1"]),
    # a full-rank query: wq in FP8 beside kv_a in bfloat16, so the normed input is kept as it is
    "mla-fp8-full-rank-q": (DEEPSEEK, MLA_FP8 + ["model.q_lora_rank=0"]),
    # kv_a 128 wide: every reader of the normed input in FP8, one FP8 copy kept for both
    "mla-fp8-kva": (DEEPSEEK, MLA_FP8 + ["model.kv_lora_rank=120"]),
    # kv_b in FP8 (256 wide), q_b (192) not; the math attention
    "mla-fp8-kvb": (DEEPSEEK, MLA_FP8 + ["model.qk_nope_head_dim=32", "model.qk_rope_head_dim=16"]),
    # as DeepSeek-V3: q_b (128 -> 256), kv_b (128 -> 384) and wo in FP8, kv_a (160) not; the fused kernel
    "mla-fp8-as-published": (DEEPSEEK, MLA_FP8 + ["model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=64"]),
    # GQA: wq 256, wk / wv 128 wide, every reader of the normed input in FP8
    "gqa-fp8": (QWEN, GQA_FP8),
    # one key / value head: wk / wv 64 wide stay bfloat16, so the normed input is kept as it is
    "gqa-fp8-one-kv-head": (QWEN, GQA_FP8 + ["model.n_kv_heads=1"]),
    # a dense layer (its FFN in FP8) before the MoE ones
    "gqa-fp8-dense": (QWEN, GQA_FP8 + ["model.n_dense=1", "model.ffn_hidden=128"]),
}
RECIPE_MEMORY = {  # name: (the memory section, the layers' option)
    "norms": ({"recompute": "norms"}, "off"),
    "norms+moe": ({"recompute": ["norms", "moe"]}, "recompute_moe"),
    "norms+level0": ({"recompute": "norms", "zero_memory": "level0"}, "level0"),
    "norms+level1": ({"recompute": "norms", "zero_memory": "level1"}, "level1"),
    "fp8_activations": ({"fp8_activations": True}, "off"),
    "fp8_activations+level0": ({"fp8_activations": True, "zero_memory": "level0"}, "level0"),
    "fp8_activations+level1": ({"fp8_activations": True, "zero_memory": "level1"}, "level1"),
    "both": ({"fp8_activations": True, "recompute": "norms"}, "off"),
    "both+moe": ({"fp8_activations": True, "recompute": ["norms", "moe"]}, "recompute_moe"),
    "both+level1": ({"fp8_activations": True, "recompute": "norms", "zero_memory": "level1"}, "level1"),
}


@pytest.mark.parametrize("name, memory", [(n, m) for n, (_, shape) in RECIPE_SHAPES.items() for m, (section, _) in RECIPE_MEMORY.items()
                                          if "train.fp8=deepseek" in shape or not section.get("fp8_activations")])  # those need train.fp8
def test_each_part_of_mla_and_gqa_saves_the_formula_under_the_norms_recompute_and_fp8_activations(name: str, memory: str) -> None:
    """deepseek_v3's latent attention under ``memory.recompute: norms`` (its latent norms' outputs,
    and the up-projected q, k, v where the fused kernel keeps them) and FP8-cached activations (the
    inputs of q_b / kv_b, and the normed input only where every reader of it runs in FP8), and
    qwen3_moe's grouped-query attention (the normed input; the per-head norms' outputs are not
    kept), alone, together, with recompute moe and zero-memory: byte for byte, part by part."""
    section, option = RECIPE_MEMORY[memory]
    example, shape = RECIPE_SHAPES[name]
    _check_parts(example, BYTES + shape, option, section)


def part_bytes(block: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[list[tuple[str, float, int]], Tape, torch.Tensor]:
    """One block's forward under the accounting: each part's (kind, units, bytes it saved), and
    the tape and output its backward runs from."""
    obs = PartBytes()
    tracker = accounting.SavedActivations(ignore=block.parameters())
    with tracker.track(), observing(obs):
        tape = Tape()
        out = run(block.program(tape, x, y))
    measured = {label: n for (label, _), n in tracker.live_by_region.items() if label in obs.units}
    return [(part, units, measured.get(label, 0)) for label, (part, units) in obs.units.items() if part != "other"], tape, out


def _check_parts(example: Path, shape: list[str], option: str, memory: dict[str, Any] | None = None) -> None:
    """``memory``: a memory section whose layer option is ``option``, with the norms' recompute
    (its dropped bytes, plan.norm_recompute) and FP8-cached activations (plan.fp8_bytes) from it."""
    cfg = load_config(example, SMALL + shape + ([f"memory.fp8_activations={str(bool(memory.get('fp8_activations'))).lower()}"] if memory else []))
    s = setup_shape(cfg)
    norms = memory is not None and "norms" in str(memory.get("recompute", ""))
    cached = cfg.memory.fp8_activations
    block, x, y = _forward(cfg, option, None if memory is None else {k: v for k, v in memory.items() if k != "fp8_activations"})
    parts, tape, out = part_bytes(block, x, y)
    layer_of = iter(range(cfg.model.n_layers))
    checked = 0
    for part, units, got in parts:
        # experts: units are the rows received; a prediction depth's rows are shorter sequences
        want = saved_bytes(s, part, option, units, units, seq=units // cfg.train.micro_batch_size if part != "experts" else None)
        if part in ("attention", "dense") and option != "recompute_full":
            want += s.rope_bytes()
        if norms:
            want -= dropped_bytes(s, part, units, cached)
        if s.fp8:
            want += saved_delta(s, cached, part, option, units, units, 0)  # one EP rank: no row travels
        # a recomputed part runs without saving; its replay (in the backward) is checked below
        assert got == want, (part, option, got, want, next(layer_of, None))
        checked += 1
    assert checked >= 2
    run(tape.backward(out, torch.ones_like(out)))


def setup_shape(cfg) -> Shape:
    """The shape the planner gives a config (its backend's attention kernels, train.fp8)."""
    return Setup.from_config(cfg).shape


def _held(block, cfg, x, y, option: str, ep: int, ignore=None) -> tuple[int, float]:
    """The storages a forward of ``block`` leaves alive besides what autograd saves (counted with
    every tensor object, as an allocator would), and what held_bytes says of it; then its backward."""
    s = Shape.of(cfg.model)
    gc.collect()
    before = {k for k in _storages()}
    tracker = accounting.SavedActivations(ignore=block.parameters() if ignore is None else ignore)
    obs = PartBytes()
    with tracker.track(), observing(obs):
        tape = Tape()
        out = run(block.program(tape, x, y))
    gc.collect()
    alive = {k: n for k, n in _storages().items() if k not in before}
    saved = set(tracker._refs)
    extra = sum(n for k, n in alive.items() if k not in saved)
    T = x.numel()
    rows = T * s.top_k  # what the formula's terms read: every routed row of the micro-batch
    parts = [part for part, _ in obs.units.values() if part not in ("other", "experts")]
    # with other EP ranks a layer runs its experts twice (received rows, own rows): held_bytes's
    # ``experts`` is one per MoE layer
    moe = sum(1 for part in parts if part == "attention") if s.n_experts else 0
    want = sum(held_bytes(s, part, option, T, rows, ep=ep) for part in parts) + moe * held_bytes(s, "experts", option, T, rows, ep=ep)
    if option == "recompute_full":  # the recomputed layers' inputs: the parts do not run under the tape
        want = s.n_layers * T * s.hidden * s.e
    want += s.e  # the loss
    run(tape.backward(out, torch.ones_like(out)))
    return extra, want


@pytest.mark.parametrize("ep", [1, 2])
def test_the_tape_holds_what_held_bytes_says(ep: int) -> None:
    """Beyond what autograd saves, the storages alive after a forward are the formula's part
    outputs and exchange buffers, under every memory option; with a peer (one process playing
    both EP ranks) the rows sent and the rows the combine brought back are released in the
    forward too, and zero-memory's and a recomputed block's dispatch plans keep their index
    buffers."""
    for shape in ([], ["model.top_k=1", "model.n_experts=4"], ["train.micro_batch_size=3"]):
        cfg = load_config(EXAMPLE, SMALL + ["model.moe_hidden=24"] + shape)
        for option in ("off", "level0", "level1", "recompute_moe", "recompute_full"):
            block, x, y = _forward(cfg, option, ep=ep)
            extra, want = _held(block, cfg, x, y, option, ep)
            assert extra == want, (shape, option, extra, want)


def _held_on_ranks(backend, raws):
    from portapipe.verify.pipelined import runtime_for

    out = {}
    for name, raw in raws.items():
        cfg = load_config(raw)
        rt, data = runtime_for(backend, raw)
        option = cfg.memory.zero_memory if cfg.memory.zero_memory != "off" else "recompute_moe"
        out[name] = _held(rt.blocks[0], cfg, data[0][0], data[0][1], option, cfg.parallel.ep, rt.parameters())
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("ep", [2, 4])
def test_held_bytes_hold_on_every_ep_rank_whatever_its_routing(ep: int) -> None:
    """The index buffers zero-memory and a recomputed MoE block keep are the same on every EP rank
    (real ranks, each with its own routing), as held_bytes says."""
    from portapipe.ranks.launch import run_ranks

    base = [f"parallel.ep={ep}", "parallel.pp=1", "parallel.dp=1", "schedule.name=1f1b", "train.micro_batch_size=2", "model.seq_len=16",
            "model.moe_hidden=24"]
    cases = {"level1": ["memory.zero_memory=level1"], "recompute_moe": ["memory.recompute=moe", "model.top_k=1"]}
    raws = {n: load_config(EXAMPLE, base + o).to_dict() for n, o in cases.items()}
    for rank in run_ranks(_held_on_ranks, ep, raws, wall_timeout_s=300):
        for name, (extra, want) in rank.items():
            assert extra == want, (name, extra, want)


def _storages() -> dict:
    out = {}
    with warnings.catch_warnings():  # isinstance on every object touches deprecated torch aliases
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in tensors:
        k = accounting.storage_key(o)
        if k is not None:
            out[k[0]] = k[1]
    return out


# ----------------------------------------------------------------------- whole schedules
STEPS = {
    "1f1b": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b"],
    "zb1p-level1": ["parallel.pp=2", "parallel.ep=1", "schedule.name=zb1p", "memory.zero_memory=level1"],
    "interleaved": ["parallel.pp=2", "parallel.ep=1", "schedule.name=interleaved"],
    "dualpipe": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipe"],
    "dualpipev-recompute": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipev", "memory.recompute=full", "memory.recompute_layers=1"],
    "dualpipev-ep2-level0": ["parallel.pp=1", "parallel.ep=2", "schedule.name=dualpipev", "memory.zero_memory=level0"],
    # a recomputed MoE block's replay routes again: not a forward of its own in the step's routing
    "1f1b-ep2-recompute-moe": ["parallel.pp=1", "parallel.ep=2", "schedule.name=1f1b", "memory.recompute=moe"],
    # multi-token prediction on the last stage (its embedding's copy and modules counted there)
    "1f1b-mtp": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "model.mtp_layers=1"],
    "dualpipev-mtp2-level1": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipev", "model.mtp_layers=2", "memory.zero_memory=level1"],
    # the norms' outputs recomputed: alone, with recompute moe, with level1 and multi-token prediction
    "1f1b-norms": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "memory.recompute=norms"],
    "dualpipev-norms+moe": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipev", "memory.recompute=norms+moe"],
    "interleaved-mtp-norms-level1": ["parallel.pp=2", "parallel.ep=1", "schedule.name=interleaved", "model.mtp_layers=1",
                                     "memory.recompute=norms", "memory.zero_memory=level1"],
}


def _step_peaks(backend, raws):
    from portapipe.training.update import make_sharded_optimizer
    from portapipe.verify.pipelined import routed_step

    out = {}
    for name, raw in raws.items():
        rt, peak, routing = routed_step(backend, raw)
        params = sum(p.numel() * p.element_size() for p in {id(p): p for p in rt.parameters()}.values())  # one tensor held twice counts once
        held = make_sharded_optimizer(rt, load_config(raw), rt.backend).memory()
        out[name] = {"pp_rank": rt.groups.pp_rank, "saved_peak": peak, "params": params, "grads": rt.grads.memory(), "routing": routing, **held}
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("example", ["portapipe", "deepseek_v3", "qwen3_moe"])
def test_schedule_peaks_and_static_memory_match_a_real_step(example: str) -> None:
    """Peak saved bytes per rank, exact (with two EP ranks, given the rows each rank's step
    routed per micro-batch: the mean routing's peak is off there, as routing varies per rank),
    and parameters, gradients, master weights and AdamW state (to the byte, but for the buckets'
    padding to equal shards), for each architecture's attention."""
    from portapipe.ranks.launch import run_ranks

    path, extra = {"portapipe": (EXAMPLE, []), "deepseek_v3": (DEEPSEEK, BYTES), "qwen3_moe": (QWEN, BYTES)}[example]
    steps = {n: o for n, o in STEPS.items() if example != "qwen3_moe" or "mtp" not in n}  # qwen3_moe has no prediction modules
    cfgs = {n: load_config(path, o + extra + ["model.seq_len=32", "parallel.dp=1"]) for n, o in steps.items()}
    per_rank = run_ranks(_step_peaks, 2, {n: c.to_dict() for n, c in cfgs.items()}, wall_timeout_s=300)
    mean_routing_off = []
    for name, cfg in cfgs.items():
        setup = Setup.from_config(cfg)
        sched = build_schedule(cfg)
        report = MemoryModel(setup, sched).report()
        for r in per_rank:
            got = r[name]
            model = report.ranks[got["pp_rank"]]
            if cfg.parallel.ep == 1:
                assert model.saved_peak == got["saved_peak"], (name, got["pp_rank"])
            else:
                routed = MemoryModel(setup, sched, routing=got["routing"]).rank(got["pp_rank"])
                assert routed.saved_peak == got["saved_peak"], (name, got["pp_rank"])
                mean_routing_off.append(model.saved_peak != got["saved_peak"])
            st = static_memory(setup, sched, got["pp_rank"])
            assert st.params == got["params"] and st.master == got["master"], name
            for part in ("grads", "optimizer"):
                assert 0 <= got[part] - getattr(st, part) <= 64 * 8, (name, part)  # a few elements of padding per bucket
    assert any(mean_routing_off)  # the rows differ per rank: somewhere the routing matters


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "dualpipe", "dualpipev-ep2-level0", "dualpipev-mtp2-level1"])
def test_a_routing_of_even_shares_is_the_mean_routing(name: str) -> None:
    """``routing`` at the even share everywhere gives the model without it, on every rank; more
    rows everywhere raise every rank's peak, fewer lower it."""
    cfg = load_config(EXAMPLE, STEPS[name] + ["model.seq_len=32", "parallel.dp=1"])
    setup, sched = Setup.from_config(cfg), build_schedule(cfg)
    plain = MemoryModel(setup, sched).report()
    m = cfg.model
    moe = [layer for layer in range(m.n_layers + m.mtp_layers) if setup.shape.is_moe(layer)]

    stage_moe = [[layer for layer in spec.layers if layer in moe] for spec in stage_specs(setup, sched)]

    def routing(rows: float, own: float = 1.0) -> dict:
        return {(v, mb): tuple((layer, rows, own) for layer in stage_moe[v]) for v in range(sched.n_stages) for mb in range(cfg.schedule.microbatches)}

    even = routing(1.0)
    for r in range(sched.n_ranks):
        assert MemoryModel(setup, sched, routing=even).rank(r).saved_peak == plain.ranks[r].saved_peak
    with pytest.raises(ValueError, match="routing: stage"):  # a layer's rows missing: refused, not the mean
        MemoryModel(setup, sched, routing={k: v[1:] for k, v in even.items()}).report()
    more, fewer = MemoryModel(setup, sched, routing=routing(1.5)), MemoryModel(setup, sched, routing=routing(0.5))
    for r in range(sched.n_ranks):
        assert fewer.rank(r).saved_peak < plain.ranks[r].saved_peak < more.rank(r).saved_peak


@pytest.mark.multiproc
def test_fp8_rows_received_from_another_ep_rank_are_kept_as_fp8() -> None:
    """train.fp8 on two EP ranks: the experts keep the rows that arrived by the dispatch as E4M3
    values and 1x128 scales, their own rows in bfloat16; each rank's peak exact given the rows its
    step routed (the mean routing's within 0.1% of the EP peers' mean, 5% of each rank's)."""
    from portapipe.ranks.launch import run_ranks

    fp8 = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=256", "train.fp8=deepseek"]
    cfg = load_config(DEEPSEEK, BYTES + fp8 + ["parallel.pp=1", "parallel.ep=2", "schedule.name=dualpipev", "model.seq_len=32"])
    got = run_ranks(_step_peaks, 2, {"fp8": cfg.to_dict()}, wall_timeout_s=300)
    setup = Setup.from_config(cfg)
    want = MemoryModel(setup, build_schedule(cfg)).report().ranks[0].saved_peak
    off = load_config(DEEPSEEK, BYTES + fp8[:-1] + ["parallel.pp=1", "parallel.ep=2", "schedule.name=dualpipev", "model.seq_len=32"])
    plain = MemoryModel(Setup.from_config(off), build_schedule(off)).report().ranks[0].saved_peak
    peaks = [r["fp8"]["saved_peak"] for r in got]
    assert want < plain  # the received rows' FP8 bytes count
    assert abs(want / (sum(peaks) / len(peaks)) - 1) < 0.001
    assert all(abs(want / p - 1) < 0.05 for p in peaks)
    for r in got:
        assert MemoryModel(setup, build_schedule(cfg), routing=r["fp8"]["routing"]).rank(0).saved_peak == r["fp8"]["saved_peak"]


def test_dualpipe_on_the_deepseek_v3_shape_keeps_two_copies_and_pp_plus_one_in_flight() -> None:
    cfg = load_config(ROOT / "examples" / "plan" / "deepseek_v3.yaml", ["schedule.microbatches=40"])
    dual = Setup.from_config(cfg)
    pp = dual.pp
    one = dual.replace(schedule="1f1b")
    sched = build_schedule(cfg)
    model = MemoryModel(dual, sched)
    rep_dual = model.report()
    rep_one = MemoryModel(one, build_schedule(load_config(ROOT / "examples" / "plan" / "deepseek_v3.yaml", ["schedule.microbatches=40", "schedule.name=1f1b"]))).report()
    # twice 1F1B's, but for the multi-token prediction module's embedding: the two ranks holding
    # the first and the last block each hold one embedding, not one per block
    s = dual.shape
    shared = 2 * s.vocab_size * s.hidden * s.e if s.mtp_layers else 0
    assert sum(r.params for r in rep_dual.ranks) == 2 * sum(r.params for r in rep_one.ranks) - shared
    assert [r.microbatches_peak for r in rep_dual.ranks] == [pp + 1] * pp
    assert [r.microbatches_peak for r in rep_one.ranks] == [pp - r for r in range(pp)]
    # the peak bytes: pp+1 chunks of the rank's two stages (one micro-batch through one stage
    # each), of which one is half way through an F&B pair (its backward releasing while the
    # other micro-batch's forward saves)
    for r, mem in enumerate(rep_dual.ranks):
        chunk = [sum(op[4] for op in model.programs.forward(model.specs[v]) if op[0] == "C") for v in sched.stages_of(r)]
        tables = sum(model._rope_bytes(model.specs[v]) for v in sched.stages_of(r))  # once per block
        assert pp * min(chunk) <= mem.saved_peak <= (pp + 1) * max(chunk) + tables, r


def test_the_shape_sizes_every_model_dtype_as_torch_does() -> None:
    """Shape.e for each model.dtype the config takes (float16 was missing: `portapipe plan` failed on it)."""
    import typing

    from portapipe.config import ModelConfig

    for dtype in typing.get_args(ModelConfig.model_fields["dtype"].annotation):
        assert Shape.of(ModelConfig(dtype=dtype)).e == torch.empty(0, dtype=getattr(torch, dtype)).element_size(), dtype


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_what_a_rank_holds_besides_does_not_grow_with_the_micro_batches(schedule: str) -> None:
    """The step lets a completed send go (tests/test_executor.py): a sent input gradient at the
    end of the next compute action, a sent stage output with its tape at the stage's backward.
    So what a rank holds besides the saved activations is the same for 4 micro-batches as for 16
    (kept to the step's end, each one sent would add its bytes)."""
    held = []
    for m in (4, 16):
        cfg = load_config(EXAMPLE, [f"schedule.name={schedule}", f"schedule.microbatches={m}", "train.micro_batch_size=1"])
        report = MemoryModel(Setup.from_config(cfg), build_schedule(cfg)).report()
        held.append([r.held_peak - r.saved_peak for r in report.ranks])
    assert held[0] == held[1] and all(h > 0 for h in held[0])


def _two_steps(backend, raw):
    from portapipe.verify.pipelined import recording_rows, routed_rows, runtime_for

    rt, data = runtime_for(backend, raw)
    with recording_rows(rt) as calls:
        rt.step(data)
        once = routed_rows(rt, calls)
        rt.step(data)
    rt.step(data)  # recorded no more
    try:
        routed_rows(rt, calls)
    except ValueError as exc:
        return once, str(exc)
    return once, None


@pytest.mark.multiproc
def test_a_steps_routing_is_recorded_per_stage_microbatch_and_layer_and_refuses_two_steps() -> None:
    from portapipe.ranks.launch import run_ranks

    cfg = load_config(EXAMPLE, ["parallel.pp=1", "parallel.ep=1", "parallel.dp=1", "schedule.name=1f1b", "model.seq_len=16"])
    ((once, refused),) = run_ranks(_two_steps, 1, cfg.to_dict(), wall_timeout_s=120)
    moe = [layer for layer in range(cfg.model.n_layers) if Setup.from_config(cfg).shape.is_moe(layer)]
    assert set(once) == {(0, mb) for mb in range(cfg.schedule.microbatches)}
    # one EP rank: every row is the rank's own, top_k per token
    assert all(per == tuple((layer, 1.0, 1.0) for layer in moe) for per in once.values())
    assert refused is not None and "ran 8 forwards" in refused
