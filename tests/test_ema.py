"""The host EMA of the weights (``train.ema_decay``), through ``portapipe train`` and its checkpoints.

A float64 run on dp 2 with zero_stage 1 (the EMA sharded like the master weights) writes a
checkpoint after every step: the EMA of the last one equals the average recomputed here from the
initial weights and every step's weights, ``ema = d x ema + (1 - d) x w``. A resume continues it
bit for bit; a checkpoint without one starts it from its weights and says so; ``--ema`` exports it.
In one process, a bfloat16 model's EMA is the float32 average of its float32 master weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.checkpoint import load_model_state
from portapipe.checkpoint.files import load_no_dist, read_dcp_metadata
from portapipe.config import ConfigError, config_from_dict, load_config
from tests.test_checkpoint_run import raw as run_config
from tests.test_checkpoint_tried import copy_run, retarget, step_dir, train

DECAY, STEPS = 0.7, 4  # not 0.5: a decay swapped with 1 - decay would pass


def _saved(ckpt: Path, prefix: str) -> dict[str, torch.Tensor]:
    meta = read_dcp_metadata(ckpt)
    out = {k[len(prefix) + 1:]: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix + ".")}
    if out:
        load_no_dist(ckpt, {prefix: out})
    return out


def _initial(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights before the first step, by logical name (one process, the run's seed)."""
    from portapipe.compose import build_model
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.scheduling.stage import logical_state

    cfg = config_from_dict(config)
    n = cfg.n_blocks()
    blocks = build_model(cfg, range(n), n, ExpertParallel(None, 1, 0, None))
    return {k: v for b in blocks.values() for k, v in logical_state([(name, p) for name, p in b.named_parameters()]).items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.cli import main

    root = tmp_path_factory.mktemp("ema")
    config = run_config(root / "run", steps=STEPS, pp=1, parallel__dp=2, schedule__microbatches=1, train__zero_stage=1,
                        train__ema_decay=DECAY, checkpoint__every=1, checkpoint__keep=10, data__val_fraction=0.1)
    (root / "run.json").write_text(json.dumps(config))
    assert main(["train", str(root / "run.json")]) == 0
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"config": config, "dir": root / "run", "rows": rows}


@pytest.mark.multiproc
def test_the_ema_is_the_average_of_every_steps_weights_sharded_over_dp(run):
    want = _initial(run["config"])
    for step in range(1, STEPS + 1):
        weights = _saved(step_dir(run["dir"], step), "model")
        want = {k: DECAY * e + (1 - DECAY) * weights[k] for k, e in want.items()}
    got = _saved(step_dir(run["dir"], STEPS), "ema")
    assert got.keys() == want.keys() and all(t.dtype == torch.float32 for t in got.values())
    for k, w in want.items():
        assert torch.allclose(got[k].double(), w, rtol=1e-6, atol=1e-7), k  # float32 in host memory: each fold rounds
    last = _saved(step_dir(run["dir"], STEPS), "model")
    assert any(not torch.allclose(got[k].double(), last[k], rtol=1e-3) for k in want)  # it lags the weights


@pytest.mark.multiproc
def test_the_run_reports_the_host_bytes_and_the_emas_validation_loss(run):
    memory = next(r for r in run["rows"] if r["kind"] == "memory")
    summary = next(r for r in run["rows"] if r["kind"] == "summary")
    # per element of the rank's shard: the moments 2 x 8 bytes (float64), the EMA 4 (float32) and its staging copy 8
    assert memory["ema_host"] * 16 == memory["optimizer"] * (4 + 8)
    assert summary["val_loss_ema"] is not None and summary["val_loss_ema"] != summary["val_loss"]
    # each step's row: the training thread's time in the EMA's update, a part of the iteration
    steps = [r for r in run["rows"] if r["kind"] == "train"]
    assert steps and all(0.0 < r["ema_s"] < r["iter_s"] for r in steps)
    # and the background thread's processor time in the previous step's fold (none before the first)
    assert steps[0]["ema_fold_s"] == 0.0 and all(0.0 < r["ema_fold_s"] < r["iter_s"] for r in steps[1:])


@pytest.mark.multiproc
def test_a_resume_continues_the_ema_bit_for_bit_and_a_checkpoint_without_one_starts_it(run, tmp_path, capsys):
    again = copy_run(run["dir"], tmp_path / "again", drop_after=2)
    code, lines, _ = train(capsys, retarget(run["config"], again))
    assert code == 0, lines
    a, b = _saved(step_dir(run["dir"], STEPS), "ema"), _saved(step_dir(again, STEPS), "ema")
    assert all(torch.equal(a[k], b[k]) for k in a)
    plain = {**run["config"], "train": {**run["config"]["train"], "ema_decay": None}}
    first = tmp_path / "plain"
    code, lines, _ = train(capsys, retarget({**plain, "train": {**plain["train"], "steps": 2}}, first))
    assert code == 0, lines
    code, lines, _ = train(capsys, retarget({**plain, "train": {**plain["train"], "ema_decay": DECAY}}, first))
    assert code == 0 and "portapipe: ema: the checkpoint holds no EMA of the weights (train.ema_decay was not set); it starts from " \
        "the weights of step 2" in lines, lines
    got = _saved(step_dir(first, 4), "ema")
    w2, w3, w4 = (_saved(step_dir(first, s), "model") for s in (2, 3, 4))
    want = {k: DECAY * (DECAY * w2[k] + (1 - DECAY) * w3[k]) + (1 - DECAY) * w4[k] for k in got}
    assert got and all(torch.allclose(got[k].double(), w, rtol=1e-6, atol=1e-7) for k, w in want.items())


@pytest.mark.multiproc
def test_export_reads_the_ema_for_the_parameters_and_refuses_a_checkpoint_without_one(run, tmp_path):
    state, _ = load_model_state(step_dir(run["dir"], STEPS), ema=True)
    weights, _ = load_model_state(step_dir(run["dir"], STEPS))
    ema = _saved(step_dir(run["dir"], STEPS), "ema")
    assert state.keys() == weights.keys() and set(ema) < set(state)  # the buffers (routers' biases) as saved
    for k, t in state.items():
        assert t.dtype == weights[k].dtype and torch.equal(t, ema[k].to(t.dtype) if k in ema else weights[k]), k
    from portapipe.cli import main

    plain = tmp_path / "plain"
    config = run_config(plain, steps=1, pp=1)
    (tmp_path / "plain.json").write_text(json.dumps(config))
    assert main(["train", str(tmp_path / "plain.json")]) == 0
    with pytest.raises(ValueError, match="holds no EMA of the weights"):
        load_model_state(step_dir(plain, 1), ema=True)


def test_a_decay_outside_zero_and_one_is_refused():
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ConfigError) as err:
            load_config({"train": {"ema_decay": bad}})
        assert len(err.value.problems) == 1 and err.value.problems[0].startswith("train.ema_decay:"), err.value.problems


@pytest.mark.multiproc
def test_a_resume_without_the_ema_says_it_drops_it(run, tmp_path, capsys):
    again = copy_run(run["dir"], tmp_path / "again", drop_after=3)
    code, lines, summary = train(capsys, retarget(run["config"], again), "--set", "train.ema_decay=null")
    assert code == 0 and summary is not None and "val_loss_ema" not in summary, lines
    assert "portapipe: ema: the checkpoint holds an EMA of the weights that this run does not keep (train.ema_decay is not set); " \
        "its checkpoints will hold none" in lines, lines
    assert _saved(step_dir(again, STEPS), "ema") == {}


def test_a_bfloat16_models_ema_is_the_float32_average_of_its_float32_master_weights() -> None:
    """A bfloat16 model with float32 master weights: the EMA folds in the master weights as they
    are, not their bfloat16 copies in the model (which round each step's small update away)."""
    from types import SimpleNamespace

    from portapipe.backends.cpu import CPUBackend
    from portapipe.optim.buckets import GradBuckets
    from portapipe.optim.ema import HostEMA
    from portapipe.optim.sharded import ShardedAdamW

    torch.manual_seed(0)
    block = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    one = SimpleNamespace(rank=0, dp=1, ep=1, dp_group=None, replica_group=None)
    grads = GradBuckets({0: block}, one, None, master_dtype=torch.float32, reduce_dtype=torch.float32, zero_stage=0,
                        bucket_mb=1.0, overlap=False, copy_sum=lambda h, t: t)
    opt = ShardedAdamW(grads, model_dtype=torch.bfloat16, zero_stage=0, betas=(0.9, 0.95), weight_decay=0.0, backend=CPUBackend())
    ema = HostEMA(opt, DECAY, CPUBackend())
    (master,) = [st.master for st in opt.states]
    want = master.double().clone()  # the average, written here in float64 from the master weights alone
    opt.lr = 1e-4  # a step far below bfloat16's spacing of the weights: the model's copy barely moves
    for _ in range(STEPS):
        grads.start()
        block(torch.randn(4, 16, dtype=torch.bfloat16)).pow(2).sum().backward()
        grads.block_done(0)
        grads.finish()
        opt.step()
        ema.update()
        want = DECAY * want + (1 - DECAY) * master.double()
    ema.close()
    (got,) = [st.ema for st in opt.states]
    assert master.dtype == torch.float32 and got.dtype == torch.float32
    assert not torch.equal(master.to(torch.bfloat16).double(), master.double())  # the master holds what bfloat16 cannot
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9)
