"""parallel.layers_per_stage: uneven stage splits.

A list (one count per model block) or Megatron's first / last counts; refused in one line when
it does not add up or leaves a block between the ends empty (every shape of split against every
layer count: each layer in exactly one block, or one line); exact under verify in every
schedule (the first or last block may hold no layer); the single-process model does not depend
on the split; checkpoints reshard between splits; the planner's memory and time models count
each block's own layers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.config import ConfigError, load_config
from portapipe.config.setup import Setup, layer_range, split_problem, stage_layers

MODEL = {"vocab_size": 32, "hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16,
         "n_experts": 4, "top_k": 2, "seq_len": 8, "n_groups": 2, "topk_groups": 1}


def test_a_split_resolves_to_each_blocks_layers() -> None:
    assert stage_layers(10, 4) == (2, 3, 2, 3)  # the even split as it always was
    assert [layer_range(10, 4, b) for b in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert stage_layers(10, 4, (4, 2, 2, 2)) == (4, 2, 2, 2)
    assert stage_layers(61, 16, (("last", 1),)) == stage_layers(60, 15) + (1,)  # DeepSeek-V3's 61 layers, the last stage lighter
    assert stage_layers(61, 16, (("first", 3), ("last", 3))) == (3,) + stage_layers(55, 14) + (3,)
    assert stage_layers(4, 4, (("first", 0),)) == (0, 1, 1, 2)
    assert [layer_range(10, 4, b, (4, 2, 2, 2)) for b in range(4)] == [(0, 4), (4, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize(
    "split, line",
    [
        ([1, 1, 1], "parallel.layers_per_stage: [1, 1, 1] has 3 entries; the schedule cuts the model into 4 model blocks, one entry each"),
        ([1, 1, 1, 2], "parallel.layers_per_stage: [1, 1, 1, 2] adds up to 5, not model.n_layers = 4"),
        ([2, 0, 1, 1], "parallel.layers_per_stage: [2, 0, 1, 1] leaves model block 1 without a layer; only the first (the embedding) "
                       "and the last (the head) may hold none"),
        ({"first": 3, "last": 1}, "parallel.layers_per_stage: first 3, last 1 leave 0 of model.n_layers = 4 layers for the other 2 "
                                  "of 4 model blocks, which need at least one each"),
        ({"first": 2}, "parallel.layers_per_stage: first 2 leaves 2 of model.n_layers = 4 layers for the other 3 "
                       "of 4 model blocks, which need at least one each"),
    ],
)
def test_a_split_that_does_not_add_up_is_refused_in_one_line(split: Any, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config("dualpipev", 2, split)
    assert info.value.problems == [f"{line} (dualpipev with pp=2)"]


def _splits(n_blocks: int, most: int) -> list[Any]:
    """Every split of each shape for ``n_blocks``: first only, last only, both ends (the blocks
    between them: none, one or several), and a list of every block's count (the middle's too)."""
    from itertools import product

    counts = range(most + 2)
    out: list[Any] = [(("first", a),) for a in counts] + [(("last", b),) for b in counts]
    out += [(("first", a), ("last", b)) for a in counts for b in counts]
    out += [tuple(c) for c in product(counts, repeat=n_blocks)]
    return out


@pytest.mark.parametrize("n_blocks", [1, 2, 3, 4])
def test_every_split_puts_each_layer_in_exactly_one_block_or_is_refused_in_one_line(n_blocks: int) -> None:
    """Against every layer count: the blocks' layers are contiguous, cover each layer once, keep
    the counts named and leave no block between the ends empty; or one line says why not (and
    stage_layers refuses it with that line)."""
    for n_layers in range(1, 7):
        for split in _splits(n_blocks, n_layers):
            problem = split_problem(n_layers, n_blocks, split)
            if problem is not None:
                assert "\n" not in problem and problem.startswith("parallel.layers_per_stage: "), (n_layers, split, problem)
                with pytest.raises(ValueError, match="^" + re.escape(problem) + "$"):
                    stage_layers(n_layers, n_blocks, split)
                continue
            counts = stage_layers(n_layers, n_blocks, split)
            ranges = [layer_range(n_layers, n_blocks, b, split) for b in range(n_blocks)]
            assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(n_layers)), (n_layers, split, counts)
            assert all(c >= 1 for c in counts[1:-1]), (n_layers, split, counts)
            named = dict(split) if split and isinstance(split[0], tuple) else {"first": split[0], "last": split[-1]}
            assert counts[0] == named.get("first", counts[0]) and counts[-1] == named.get("last", counts[-1]), (n_layers, split, counts)


def test_first_and_last_that_leave_layers_over_with_no_block_between_are_refused() -> None:
    """1F1B on pp 2 has two model blocks, both named: {first: 2, last: 2} of 6 layers would leave 2
    of them in no block."""
    with pytest.raises(ConfigError) as info:
        _config("1f1b", 2, {"first": 2, "last": 2}, n_layers=6)
    assert info.value.problems == ["parallel.layers_per_stage: first 2, last 2 leave 2 of model.n_layers = 6 layers for the other 0 "
                                   "of 2 model blocks, which need at least one each and all of them (1f1b with pp=2)"]


@pytest.mark.parametrize(
    "value, line",
    [
        ("[1, 'a']", "expected a list of whole numbers of layers >= 0, one per model block, or {first: n, last: m}"),
        ("[1, true, 1, 1]", "expected a list of whole numbers of layers >= 0, one per model block, or {first: n, last: m}"),
        ("{middle: 2}", "expected first and / or last as keys, got ['middle']"),
        ("{first: -1}", "first and last take whole numbers of layers >= 0"),
    ],
)
def test_a_split_of_the_wrong_kind_is_refused_in_one_line(value: str, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"model": MODEL}, [f"parallel.layers_per_stage={value}"])
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("parallel.layers_per_stage: ")
    assert info.value.problems[0].endswith(line)


def _config(name: str, pp: int, split: Any, ep: int = 1, chunks: int = 2, **model: Any) -> Any:
    mb = 2 * pp if name in ("dualpipe", "dualpipev") else pp * (2 if name == "interleaved" else 1)
    return load_config({
        "backend": "cpu", "parallel": {"pp": pp, "ep": ep, "dp": 1, "layers_per_stage": split},
        "schedule": {"name": name, "microbatches": mb, "chunks": chunks} if name == "interleaved" else {"name": name, "microbatches": mb},
        "model": {**MODEL, **model}, "train": {"micro_batch_size": 2, "seed": 5},
    })


SPLITS = [
    ("1f1b", 2, [1, 3], 2, {}),
    ("zb1p", 2, {"first": 3}, 2, {}),
    ("interleaved", 2, [0, 2, 1, 1], 2, {}),  # the first block: the embedding alone
    ("dualpipe", 2, [3, 1], 2, {}),
    ("dualpipev", 2, [1, 1, 2, 0], 2, {"mtp_layers": 1}),  # the last block: the head and the prediction module alone
    ("dualpipev", 2, {"last": 0}, 2, {"tie_word_embeddings": True}),
]


@pytest.mark.multiproc
def test_verify_is_exact_with_uneven_splits_in_every_schedule() -> None:
    from portapipe.compose import build_model
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.backends.cpu import CPUBackend
    from portapipe.verify import verify_many

    configs = [_config(name, pp, split, ep, **model) for name, pp, split, ep, model in SPLITS]
    for c in configs:  # the blocks hold the split's layers
        blocks = build_model(c, range(c.n_blocks()), c.n_blocks(), ExpertParallel(CPUBackend()))
        assert tuple(len(blocks[b].main_layers()) for b in range(c.n_blocks())) == stage_layers(4, c.n_blocks(), c.stage_split())
    reports = verify_many(configs)
    bad = [(r.schedule, r.loss_diff, r.max_rel_grad_diff) for r in reports if not r.ok]
    assert not bad, bad
    for r in reports:
        assert r.loss_diff == 0.0 and r.max_rel_grad_diff <= 1e-12 and r.max_bias_diff == 0.0


def test_the_single_process_model_does_not_depend_on_the_split() -> None:
    from portapipe.verify.reference import reference

    even = reference(_config("dualpipev", 2, None, mtp_layers=1))
    for split in ([1, 1, 2, 0], [0, 3, 1, 0], {"first": 0}):
        loss, grads, biases = reference(_config("dualpipev", 2, split, mtp_layers=1))
        assert loss == even[0]
        assert grads.keys() == even[1].keys() and all(torch.equal(grads[k], even[1][k]) for k in grads)
        assert all(torch.equal(biases[k], even[2][k]) for k in biases)


# ---------------------------------------------------------------------- checkpoints reshard
def _train_raw(log_dir: Path, steps: int, split: Any, name: str = "1f1b", **more: Any) -> dict[str, Any]:
    return {"backend": "cpu", "parallel": {"pp": 2, "ep": 1, "dp": 1, "layers_per_stage": split},
            "schedule": {"name": name, "microbatches": 4}, "model": {**MODEL, "vocab_size": 256, "dtype": "float64"},
            "train": {"steps": steps, "micro_batch_size": 2}, "data": {"val_fraction": 0.0},
            "log": {"dir": str(log_dir), "progress": False}, "checkpoint": {"every": 2}, **more}


def _losses(log_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


@pytest.mark.multiproc
def test_checkpoints_reshard_between_an_even_and_an_uneven_split_and_between_splits(tmp_path) -> None:
    from portapipe.train import train

    train(load_config(_train_raw(tmp_path / "straight", 6, None)))
    train(load_config(_train_raw(tmp_path / "moved", 2, None)))  # even
    train(load_config(_train_raw(tmp_path / "moved", 4, [3, 1])))  # to uneven
    train(load_config(_train_raw(tmp_path / "moved", 6, {"first": 0}, name="dualpipev")))  # to another, 4 blocks, the first empty
    straight, moved = _losses(tmp_path / "straight"), _losses(tmp_path / "moved")
    assert len(moved) == 6
    assert moved == pytest.approx(straight, rel=1e-12, abs=0)


# ------------------------------------------------------------------------------- the planner
def test_the_planners_memory_and_time_models_count_each_blocks_own_layers() -> None:
    from portapipe.backends.cpu import CPUBackend
    from portapipe.compose import build_model
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.plan.memory_model import static_memory
    from portapipe.plan.time_model import _block_count
    from portapipe.scheduling.executor import build_schedule

    for split in (None, [3, 1], [0, 4], {"last": 0}):
        c = _config("1f1b", 2, split)
        setup, sched = Setup.from_config(c), build_schedule(c)
        blocks = build_model(c, range(2), 2, ExpertParallel(CPUBackend()))
        for rank in range(2):
            real = sum(p.numel() for p in blocks[rank].parameters())
            assert static_memory(setup, sched, rank).params == real * 4, (split, rank)  # float32
            assert _block_count(setup, setup.shape, rank, 2).elements == real, (split, rank)
    assert Setup.from_config(_config("1f1b", 2, [3, 1])).max_stage_layers == 3
    assert Setup.from_config(_config("1f1b", 2, [3, 1])).overrides()["parallel.layers_per_stage"] == [3, 1]


def test_split_problem_without_a_split_is_the_one_layer_per_block_rule() -> None:
    assert split_problem(3, 4, None) == "model.n_layers = 3 cannot be cut into 4 blocks of at least one layer"
    assert split_problem(4, 4, None) is None


def test_the_planner_offers_a_lighter_last_block_where_it_holds_multi_token_prediction_and_prices_it() -> None:
    from portapipe.plan.planner import enumerate_setups, lighter_last

    c = load_config({"backend": "cpu", "model": {**MODEL, "n_layers": 8, "mtp_layers": 1},
                     "parallel": {"pp": 2}, "schedule": {"name": "1f1b", "microbatches": 2}})
    user = Setup.from_config(c)
    (light,) = lighter_last(user)
    assert light.layers_per_stage == (("last", 3),) and light.split == (5, 3)  # 8 layers: 4 + 4 evenly; the last pays for the module
    assert lighter_last(Setup.from_config(load_config({"model": MODEL}))) == []  # no module: nothing to pay for
    setups = list(enumerate_setups(user, 2))
    assert any(x.layers_per_stage == (("last", 3),) and x.pp == 2 and x.schedule == "1f1b" for x in setups)
    assert all(x.layers_per_stage in (None, (("last", 3),)) for x in setups if x.n_blocks == 2)
    # the time model prices each block's own layers: the lighter last block's forward is cheaper
    from portapipe.plan.planner import _Context, evaluate
    from portapipe.plan.published import published

    ctx = _Context(published("h800", user.shape), lambda ep: 1.0)
    times = {}
    for x in (user, light):
        cand = evaluate(x, None, ctx, search_zero=False)
        assert cand.kept, cand.problems
        sched = ctx.schedule(x)[0]
        last = next(a for a in sched.actions[1] if a.kind.value == "F")
        times[x.layers_per_stage] = cand.model.action(last).wall
    assert times[(("last", 3),)] < times[None]
