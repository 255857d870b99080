"""Checkpoints on disk: complete only when whole, damage named and passed over, any device.

Two launches of 2 gloo ranks (pp 2) train two runs of 4 steps with a checkpoint every step (R1;
R2 with another learning rate, so their files differ, in the second launch on a backend that
reports another device type, which then also loads R1's cpu-written checkpoint). The tests damage
copies of R1's folder the ways a crash, a disk or a user would, and check what a new run would
start from (no ranks are started for that: the launcher decides before any rank starts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.checkpoint import files, list_checkpoints, load_model_state
from portapipe.checkpoint.run import prepare_run
from portapipe.config import ConfigError, load_config

MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float64"}


def config(log_dir: Path, steps: int = 4, **over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "backend": "cpu",
        "parallel": {"pp": 2, "ep": 1, "dp": 1},
        "schedule": {"name": "1f1b", "microbatches": 2},
        "model": MODEL,
        "train": {"steps": steps, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 1},
        "data": {"val_fraction": 0.0},
        "log": {"dir": str(log_dir), "progress": False},
        "checkpoint": {"every": 1, "keep": 4},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        raw.setdefault(section, {})[name] = value
    return load_config(raw).to_dict()


def _first(backend: Any, r1: dict[str, Any]) -> str:
    from portapipe.train import train_rank

    return train_rank(backend, r1)["run_id"]


def _second(backend: Any, r2: dict[str, Any], other: dict[str, Any], source: str) -> dict[str, Any]:
    """A second process whose backend reports another device type: R2, then R1's checkpoint loaded."""
    from portapipe.train import train_rank

    return {"R2": train_rank(OtherDevice(backend.options), r2)["run_id"], "double": _load_on_other_device(backend, other)}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    root = tmp_path_factory.mktemp("ckfiles")
    first = run_ranks(_first, 2, config(root / "R1"), wall_timeout_s=300)[0]
    source = root / "R1" / "checkpoints" / "step_00000004"
    other = config(root / "other", steps=4, checkpoint__load=str(source))
    second = run_ranks(_second, 2, config(root / "R2", train__lr=2e-2), other, str(source), wall_timeout_s=300)[0]
    return {"root": root, "R1": root / "R1", "R2": root / "R2", "ids": [first, second["R2"]], "double": second["double"]}


@pytest.fixture
def r1(made: dict[str, Any], tmp_path: Path) -> Path:
    """A private copy of R1's run folder to damage."""
    copy = tmp_path / "R1"
    shutil.copytree(made["R1"], copy, ignore=shutil.ignore_patterns(".portapipe.lock"))
    return copy


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _decide(run: Path, **over: Any) -> tuple[Any, list[str]]:
    """What a new ``portapipe train`` in ``run`` would start from, and the lines it would print."""
    said: list[str] = []
    plan, locks = prepare_run(load_config(config(run, steps=6, **over)), "cpu", said.append)
    locks.release()
    return plan, said


# ------------------------------------------------------------------------------ complete
@pytest.mark.multiproc
def test_a_run_writes_complete_checkpoints_with_a_manifest_last(made):
    entries = list_checkpoints(made["R1"])
    assert [e["step"] for e in entries] == [1, 2, 3, 4] and all(e["complete"] for e in entries)
    assert {e["run_id"] for e in entries} == {made["ids"][0]}
    d = _ckpt(made["R1"], 4)
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["format"] == files.FORMAT and manifest["step"] == 4 and manifest["run_id"] == made["ids"][0]
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest["layout"]["pp"] == 2 and manifest["layout"]["device_type"] == "cpu"
    assert manifest["trainer"]["lr_schedule_steps"] is None and manifest["trainer"]["data"]["global_batch"] == 4  # no decay: the default
    assert not any(p.is_dir() and p.name.startswith(".") for p in (made["R1"] / "checkpoints").iterdir())  # no unfinished saves left


@pytest.mark.multiproc
def test_the_checkpoints_command_lists_a_folder_as_json(made, capsys):
    from portapipe.cli import main

    assert main(["checkpoints", str(made["R1"])]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["complete"], e["why_not"]) for e in listed] == [(s, True, None) for s in (1, 2, 3, 4)]
    assert listed[0]["layout"]["schedule"] == "1f1b" and listed[0]["path"].endswith("step_00000001")
    assert main(["checkpoints", str(made["root"] / "nowhere")]) == 2


# ------------------------------------------------------------------------------ damage
def _truncate(d: Path) -> None:
    f = d / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage_part(d: Path) -> None:
    f = d / "__0_0.distcp"
    size = f.stat().st_size
    f.write_bytes((b"\x00garbage" * size)[:size])  # same size: only the checksum tells


def _garbage_manifest(d: Path) -> None:
    (d / "manifest.json").write_bytes(b"{not json\xff")


def _missing_part(d: Path) -> None:
    (d / "__1_0.distcp").unlink()


def _missing_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


DAMAGE = {
    "truncated part": (_truncate, "part __1_0.distcp has"),
    "garbage part": (_garbage_part, "part __0_0.distcp does not match its checksum"),
    "garbage manifest": (_garbage_manifest, "manifest.json is not valid JSON"),
    "missing part": (_missing_part, "part __1_0.distcp is missing"),
    "missing manifest": (_missing_manifest, "no manifest.json"),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_once_and_the_previous_one_used(r1, kind):
    damage, why = DAMAGE[kind]
    damage(_ckpt(r1, 4))
    plan, said = _decide(r1)
    assert plan.mode == "resume" and plan.step == 3 and plan.source == str(_ckpt(r1, 3))
    warned = [line for line in said if "step_00000004" in line]
    assert len(warned) == 1 and why in warned[0] and "trying the previous one" in warned[0], said
    listed = {e["step"]: e for e in list_checkpoints(r1)}
    assert not listed[4]["complete"] and why in listed[4]["why_not"] and listed[3]["complete"]


@pytest.mark.multiproc
def test_old_manifest_with_parts_of_another_save_is_not_complete(r1, made):
    """A save of step 4 killed half-way over an older step 4: old manifest, new parts, one old part."""
    d = _ckpt(r1, 4)
    shutil.copy(_ckpt(made["R2"], 4) / "__0_0.distcp", d / "__0_0.distcp")
    shutil.copy(_ckpt(made["R2"], 4) / ".metadata", d / ".metadata")
    plan, said = _decide(r1)
    warned = [line for line in said if "step_00000004" in line]
    assert plan.step == 3 and len(warned) == 1 and ("part .metadata" in warned[0] or "part __0_0.distcp" in warned[0]), said


@pytest.mark.multiproc
def test_a_part_of_another_run_is_found_even_with_matching_checksums(r1, made):
    d = _ckpt(r1, 4)
    shutil.copy(_ckpt(made["R2"], 4) / "__1_0.distcp", d / "__1_0.distcp")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["files"]["__1_0.distcp"] = files.file_digest(d / "__1_0.distcp")  # as if the manifest had been rewritten too
    (d / "manifest.json").write_text(json.dumps(manifest))
    entry = files.verify(d)
    assert not entry.complete and entry.why == f"the part of rank 1 belongs to run {made['ids'][1]} step 4, not to this manifest's"


@pytest.mark.multiproc
def test_a_checkpoint_of_another_run_in_the_folder_is_passed_over(r1, made):
    shutil.rmtree(_ckpt(r1, 4))
    shutil.copytree(_ckpt(made["R2"], 4), _ckpt(r1, 4))
    plan, said = _decide(r1)
    assert plan.step == 3 and plan.run_id == made["ids"][0]
    assert any(f"belongs to run {made['ids'][1]}, not to this folder's run {made['ids'][0]}" in line for line in said)


@pytest.mark.multiproc
def test_pruning_after_a_resume_keeps_what_the_run_resumed_from_not_the_damaged_newer_one(r1, made):
    """Resumed from step 2 because 3 and 4 are damaged, the run writes 3 with checkpoint.keep: 1:
    step 3 stays, and the damaged step 4 it has not reached yet does not count as kept."""
    _truncate(_ckpt(r1, 4))
    shutil.rmtree(_ckpt(r1, 3))
    shutil.copytree(_ckpt(r1, 2), _ckpt(r1, 3))  # stands for the new step-3 checkpoint
    files.prune(r1 / "checkpoints", made["ids"][0], keep=1, newest=3)
    assert sorted(p.name for p in (r1 / "checkpoints").iterdir() if p.is_dir()) == ["step_00000003", "step_00000004"]


@pytest.mark.multiproc
def test_an_unfinished_save_is_not_a_checkpoint_and_is_cleared_on_resume(r1):
    tmp = r1 / "checkpoints" / ".step_00000005.someone.tmp"
    shutil.copytree(_ckpt(r1, 4), tmp)
    (tmp / "manifest.json").unlink()
    plan, said = _decide(r1)
    assert plan.step == 4 and said and not tmp.exists()
    assert [e["complete"] for e in list_checkpoints(r1)] == [True] * 4


@pytest.mark.multiproc
def test_with_no_complete_checkpoint_left_the_run_exits_2_with_one_line(r1, capsys):
    from portapipe.cli import main

    for step in (1, 2, 3, 4):
        _truncate(_ckpt(r1, step))
    raw = config(r1, steps=6)
    path = r1 / "c.json"
    path.write_text(json.dumps(raw))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "config error" in line]
    assert len(errors) == 1 and "checkpoint.resume: no complete checkpoint left in" in errors[0], err
    assert "Traceback" not in err


@pytest.mark.multiproc
def test_checkpoint_load_names_what_is_wrong_with_the_path(r1, tmp_path):
    _garbage_manifest(_ckpt(r1, 4))
    with pytest.raises(ConfigError, match=r"checkpoint.load: .*step_00000004 is not a complete checkpoint: manifest.json is not valid JSON"):
        _decide(tmp_path / "new", checkpoint__load=str(_ckpt(r1, 4)))
    plan, _ = _decide(tmp_path / "new2", checkpoint__load=str(r1))  # a folder: its newest complete one
    assert plan.mode == "load" and plan.step == 3 and plan.run_id != files.read_manifest(_ckpt(r1, 3))["run_id"]
    with pytest.raises(ConfigError, match="holds no checkpoints"):
        _decide(tmp_path / "new3", checkpoint__load=str(tmp_path))
    with pytest.raises(ConfigError, match=r"checkpoint.load: .*manifest.json is a file; give a checkpoint folder \(step_NNNNNNNN\) or a folder of checkpoints"):
        _decide(tmp_path / "new4", checkpoint__load=str(_ckpt(r1, 3) / "manifest.json"))
    with pytest.raises(ConfigError, match=r"checkpoint.load: .*nowhere does not exist"):
        _decide(tmp_path / "new5", checkpoint__load=str(tmp_path / "nowhere"))


@pytest.mark.multiproc
def test_a_save_killed_between_its_two_renames_leaves_the_previous_checkpoint_and_nothing_kept(r1, monkeypatch):
    """Publishing over an unusable checkpoint of the same step moves that one aside, then renames
    the new one into place; killed in between, the next run resumes the step before and clears both."""
    _truncate(_ckpt(r1, 4))
    new = r1 / "checkpoints" / ".step_00000004.somerun.tmp"
    shutil.copytree(_ckpt(r1, 3), new)
    real = files.os.replace
    calls: list[Any] = []

    def killed_at_the_second(src: Any, dst: Any) -> None:
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands for the kill
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        files.publish(new, _ckpt(r1, 4))
    monkeypatch.setattr(files.os, "replace", real)
    assert not _ckpt(r1, 4).exists()
    plan, said = _decide(r1)
    assert plan.step == 3 and sorted(p.name for p in (r1 / "checkpoints").iterdir() if p.is_dir()) == [f"step_0000000{s}" for s in (1, 2, 3)]


# -------------------------------------------------------------------- any device type
class OtherDevice(CPUBackend):
    """Test double: a CPU backend that reports device type ``npu`` and keeps an ``npu`` RNG state."""

    name = "otherdevice"
    device_type = "npu"
    npu_rng = torch.arange(16, dtype=torch.uint8)

    def device_module(self) -> Any:
        return torch.cpu

    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {**super().get_rng_state(), "npu": self.npu_rng.clone()}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        super().set_rng_state(state)
        self.npu_rng = state.get("npu", self.npu_rng)


def _load_on_other_device(backend: Any, raw: dict[str, Any]) -> dict[str, Any]:
    """Load ``source`` on the double; gather every rank's logical share; write it again from the double."""
    import torch.distributed as dist

    from portapipe.checkpoint.io import Checkpointer
    from portapipe.checkpoint.run import plan_on_ranks
    from portapipe.checkpoint.state import capture
    from portapipe.config import config_from_dict
    from portapipe.compose import PipelineRuntime
    from portapipe.training.update import make_sharded_optimizer

    other = OtherDevice(backend.options)
    cfg = config_from_dict(raw)
    groups = other.parallel_groups(cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.ep)
    plan, locks = plan_on_ranks(cfg, other, groups.rank, None)
    runtime = PipelineRuntime(cfg, other, groups)
    optimizer = make_sharded_optimizer(runtime, cfg, other)
    ckpt = Checkpointer(plan, cfg, other, groups.rank, groups.world_size, runtime, optimizer, None)
    trainer = ckpt.restore()
    share = capture(runtime, optimizer, None, None)
    parts: list[Any] = [None] * groups.world_size
    dist.all_gather_object(parts, share)
    path = ckpt.save_training(trainer["progress"]["step"], trainer)
    locks.release()
    return {"parts": parts, "rng": other.get_rng_state(), "written": str(path), "device": other.device_type}


def _flat(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _everything(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint but the stamps, read in this (CPU, single) process."""
    meta = files.read_dcp_metadata(d)
    state: dict[str, Any] = {}
    for key, m in meta.items():
        if not key.startswith("stamp."):
            state[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    files.load_no_dist(d, state)
    return state


@pytest.mark.multiproc
def test_a_cpu_checkpoint_loads_on_another_device_type_to_the_same_state_and_back(made):
    source = _ckpt(made["R1"], 4)
    got = made["double"]
    saved = _everything(source)
    loaded: dict[str, torch.Tensor] = {}
    for part in got["parts"]:
        loaded.update(_flat(part))
    want = {k: v for k, v in saved.items() if not k.startswith("rng.")}
    assert sorted(loaded) == sorted(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want)  # model, AdamW moments and steps, bit for bit
    assert torch.equal(got["rng"]["cpu"], saved["rng.cpu"])  # the cpu generator restored; the npu one kept
    assert torch.equal(got["rng"]["npu"], torch.arange(16, dtype=torch.uint8))

    # ... and what the double wrote reads back on the CPU to the same state, with its npu RNG state
    written = Path(got["written"])
    assert files.verify(written).complete and files.read_manifest(written)["layout"]["device_type"] == "npu"
    again = _everything(written)
    assert torch.equal(again["rng.npu"], torch.arange(16, dtype=torch.uint8))
    assert all(torch.equal(again[k], want[k]) for k in want)
    model, cfg = load_model_state(written)
    assert cfg["model"] == MODEL | {k: v for k, v in cfg["model"].items() if k not in MODEL}
    assert all(torch.equal(model[k[len("model."):]], want[k]) for k in want if k.startswith("model."))
