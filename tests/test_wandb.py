"""log.wandb: the metrics as a Weights & Biases run, from the same lines as TensorBoard's scalars.

A double of wandb's API checks what portapipe asks of it (the run named by the run id, the config,
each line's numbers at its step, the run finished); a real offline run (no network) of a short
training is read back from its ``.wandb`` file and holds every metrics line's numbers.
"""

from __future__ import annotations

import json
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from portapipe.config import ConfigError, load_config
from portapipe.metrics.log import MetricsLog
from portapipe.metrics.tensorboard_sink import scalars

MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float64"}


class _Run:
    def __init__(self, **kwargs: Any) -> None:
        self.init = kwargs
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.finished = False

    def log(self, values: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(values)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture()
def wandb_double(monkeypatch: pytest.MonkeyPatch) -> list[_Run]:
    runs: list[_Run] = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: runs.append(_Run(**kwargs)) or runs[-1]  # type: ignore[attr-defined]
    module.Settings = lambda **kwargs: ("settings", kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


LINES = [
    {"kind": "memory", "step": 0, "params": 10, "launch": {"pinned": False}},
    {"kind": "train", "step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": 2.0, "clipped": True, "a2a_hidden_pct": None},
    {"kind": "train", "step": 2, "loss": 5.25, "lr": 2e-3, "grad_norm": 1.5, "clipped": False, "balancer": {"moved": 3}},
    {"kind": "summary", "steps": 2, "val_loss": 5.3, "run_id": "r"},
]


def test_the_run_gets_each_lines_numbers_at_its_step_as_tensorboard_does(tmp_path, wandb_double) -> None:
    from portapipe.metrics.wandb_sink import WandbLog

    settings = load_config({"log": {"wandb": {"mode": "offline", "project": "p", "entity": "e"}}}).log.wandb
    sink = WandbLog(tmp_path, "run-1", settings, {"a": 1})
    log = MetricsLog(tmp_path, None, sinks=[sink])
    for line in LINES:
        log.write(line)
    log.close()
    (run,) = wandb_double
    assert run.init == {"project": "p", "entity": "e", "mode": "offline", "id": "run-1", "name": "run-1", "dir": str(tmp_path),
                        "resume": "allow", "config": {"a": 1}, "settings": ("settings", {"console": "off", "silent": True})}
    assert run.logged == [s for s in map(scalars, LINES) if s is not None]
    assert run.logged[1] == (1, {"train/loss": 5.5, "train/lr": 1e-3, "train/grad_norm": 2.0})
    assert run.logged[-1] == (2, {"val/loss": 5.3})
    assert run.finished


def test_without_the_package_the_run_is_refused_in_one_line(monkeypatch) -> None:
    from portapipe.metrics.wandb_sink import wandb_problems

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    c = load_config({"log": {"wandb": {"mode": "offline"}}})
    assert wandb_problems(c.log.wandb) == ["log.wandb.mode: offline needs the wandb package: pip install 'portapipe[wandb]'"]
    assert wandb_problems(load_config({}).log.wandb) == []


def test_online_without_a_login_is_refused_before_launch_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    """wandb's own lookup of credentials (environment, netrc, its settings) without the network:
    none found, the run is refused before any rank starts; a key in WANDB_API_KEY passes."""
    pytest.importorskip("wandb")
    import portapipe.ranks.launch
    from portapipe.cli import main
    from portapipe.metrics.wandb_sink import wandb_problems

    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_CONFIG_DIR", "NETRC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    online = load_config({"log": {"wandb": {"mode": "online"}}}).log.wandb
    problems = wandb_problems(online)
    assert len(problems) == 1 and problems[0].startswith("log.wandb.mode: online needs a W&B login and none is configured here: "
                                                         "run `wandb login` (or set WANDB_API_KEY), or use log.wandb.mode: offline")
    assert wandb_problems(load_config({"log": {"wandb": {"mode": "offline"}}}).log.wandb) == []  # offline needs none
    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"backend": "cpu", "log": {"dir": str(tmp_path / "run"), "wandb": {"mode": "online"}}}))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "log.wandb.mode: online needs a W&B login" in err and "wandb:" not in err  # wandb's own lines stay out
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # a key wandb finds (not checked against the server)
    assert wandb_problems(online) == []


def test_the_modes_keys() -> None:
    assert load_config({}, ["log.wandb.mode=off"]).log.wandb.mode == "off"  # YAML 1.1's off is the word
    with pytest.raises(ConfigError) as info:
        load_config({}, ["log.wandb.mode=cloud"])
    assert info.value.problems == ["log.wandb.mode: 'cloud': Input should be 'off', 'online' or 'offline'"]
    with pytest.raises(ConfigError) as info:
        load_config({}, ["log.wandb.projct=x"])
    assert info.value.problems == ["log.wandb.projct: unknown key"]
    assert load_config({}, ["log.wandb=offline"]).log.wandb.mode == "offline"  # a mode alone
    assert load_config({}, ["log.wandb=off"]).log.wandb.mode == "off"
    with pytest.raises(ConfigError) as info:
        load_config({}, ["log.wandb=true"])
    assert info.value.problems == ["log.wandb: True: expected a mode (off, online or offline) or {mode, project, entity}"]


# ----------------------------------------------------------------------- an offline run, read back
def read_offline_run(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file (W&B's log format: a 7-byte header, then 32 KiB blocks of
    records, each a 7-byte header (crc32, length, type: full / first / middle / last) and its data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, part, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
    return out


@pytest.mark.multiproc
def test_an_offline_run_holds_every_metrics_line_and_needs_no_network(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    from portapipe.train import train

    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: no network used
    config = load_config({
        "backend": "cpu", "parallel": {"pp": 1, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2}, "model": MODEL,
        "train": {"steps": 3, "micro_batch_size": 2}, "data": {"val_fraction": 0.1}, "log": {"dir": str(tmp_path), "progress": False,
                                                                                          "wandb": {"mode": "offline"}},
    })
    summary = train(config)
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = read_offline_run(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == summary["run_id"] and run.project == "portapipe"
    logged: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            logged.setdefault(r.history.step.num, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    want: dict[int, dict[str, float]] = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        found = scalars(json.loads(line))
        if found is not None:
            want.setdefault(found[0], {}).update(found[1])
    assert logged == want
    assert logged[3]["train/loss"] == summary["final_loss"] and logged[3]["val/loss"] == summary["val_loss"]
