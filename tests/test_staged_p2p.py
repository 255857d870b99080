"""Ranks sharing a GPU over gloo: the pipeline's point-to-point staged through host buffers.

gloo stages device tensors itself in its collectives but not in send / recv, so the cuda backend
with ``dist_backend: gloo`` posts its sends and receives through :class:`HostStagedP2P`. Here the
same logic runs for real on gloo ranks, the CPU playing the device (tests/staged_backend.py):
a double of gloo's point-to-point refuses every tensor that is not a host buffer the staging made,
and every schedule at pp 2 x ep 2 (with EPLB, LPLB and ZeRO 2 on some) verifies exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from portapipe.backends.staged_p2p import HostStagedP2P, HostStaging, copy_staging
from tests import staged_backend

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")


class _Op:
    """torch's P2POp without a process group (its constructor needs one)."""

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None, tag: int = 0,
                 group_peer: int | None = None) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag, self.group_peer = op, tensor, peer, group, tag, group_peer


@pytest.fixture(autouse=True)
def no_group_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "P2POp", _Op)


class _Work:
    def __init__(self) -> None:
        self.waited = 0
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        self.waited += 1
        return True

    def is_completed(self) -> bool:
        return self.done


def _recorder() -> tuple[list[Any], Any]:
    posted: list[Any] = []

    def post(ops: list[Any]) -> list[_Work]:
        posted.extend(ops)
        return [_Work() for _ in ops]

    return posted, post


def test_device_tensors_travel_through_host_buffers_and_land_at_wait() -> None:
    posted, post = _recorder()
    p2p = HostStagedP2P(copy_staging(is_host=lambda t: False), post=post)  # every tensor is "device"
    sent = torch.arange(6.0).reshape(2, 3)
    got = torch.full((4,), -1.0)
    works = p2p.batch_isend_irecv([dist.P2POp(dist.isend, sent, 1, tag=3), dist.P2POp(dist.irecv, got, 1, tag=4)])
    send_op, recv_op = posted
    # what the library sees: host buffers, never the device tensors, with peer and tag kept
    assert send_op.tensor is not sent and torch.equal(send_op.tensor, sent)
    assert recv_op.tensor is not got and recv_op.tensor.shape == got.shape
    assert (send_op.peer, send_op.tag, recv_op.peer, recv_op.tag) == (1, 3, 1, 4)
    recv_op.tensor.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # the library fills the host buffer
    assert torch.equal(got, torch.full((4,), -1.0))  # not yet: the data lands when waited on
    assert works[1].wait() is True
    assert torch.equal(got, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    works[0].wait()
    assert works[0]._work.waited == 1


def test_a_completed_receive_lands_when_seen_completed_and_host_tensors_go_as_they_are() -> None:
    posted, post = _recorder()
    p2p = HostStagedP2P(copy_staging(is_host=lambda t: t.dtype == torch.float64), post=post)
    host = torch.zeros(2, dtype=torch.float64)
    dev = torch.zeros(3)
    works = p2p.batch_isend_irecv([dist.P2POp(dist.irecv, host, 0), dist.P2POp(dist.irecv, dev, 0)])
    assert posted[0].tensor is host and works[0] is works[0]  # a host tensor is posted as it is
    assert posted[1].tensor is not dev
    posted[1].tensor.fill_(7.0)
    inner = works[1]._work
    assert works[1].is_completed() is False and torch.equal(dev, torch.zeros(3))
    inner.done = True
    assert works[1].is_completed() is True and torch.equal(dev, torch.full((3,), 7.0))
    assert p2p.batch_isend_irecv([]) == []


def test_a_batch_the_library_completes_as_one_work_still_lands_each_receive() -> None:
    """NCCL coalesces a batch into one work: each operation still gets its own staged handle, and
    every receive lands when that work is waited on or seen completed."""
    posted: list[Any] = []
    single = _Work()

    def coalescing(ops: list[Any]) -> list[_Work]:
        posted.extend(ops)
        return [single]

    p2p = HostStagedP2P(copy_staging(is_host=lambda t: False), post=coalescing)
    a, b = torch.zeros(2), torch.zeros(3)
    works = p2p.batch_isend_irecv([dist.P2POp(dist.irecv, a, 1), dist.P2POp(dist.isend, torch.ones(4), 1), dist.P2POp(dist.irecv, b, 1)])
    assert len(works) == 3
    posted[0].tensor.fill_(1.0)
    posted[2].tensor.fill_(2.0)
    single.done = True
    assert works[2].is_completed() and torch.equal(b, torch.full((3,), 2.0))
    works[0].wait()
    assert torch.equal(a, torch.ones(2))


def test_the_sends_host_copies_have_landed_before_a_batch_of_sends_and_receives_is_posted() -> None:
    """On a GPU the host copies run on a stream while the library reads the buffers from its own
    thread: every to_host of the batch, then one host_ready, then the post (a recording staging)."""
    events: list[str] = []
    base = copy_staging(is_host=lambda t: False)
    staging = HostStaging(
        host_empty=base.host_empty,
        to_host=lambda dst, src: (events.append("to_host"), base.to_host(dst, src)),
        host_ready=lambda: events.append("host_ready"),
        to_device=base.to_device,
        on_host=base.on_host,
    )
    posted, post = _recorder()
    p2p = HostStagedP2P(staging, post=lambda ops: (events.append("post"), post(ops))[1])
    ops = [dist.P2POp(dist.isend, torch.ones(2), 1), dist.P2POp(dist.irecv, torch.zeros(2), 1), dist.P2POp(dist.isend, torch.ones(3), 1)]
    p2p.batch_isend_irecv(ops)
    assert events == ["to_host", "to_host", "host_ready", "post"]
    events.clear()
    p2p.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(2), 1)])  # receives only: nothing to wait for
    assert events == ["post"]


def test_an_op_naming_its_peer_by_group_rank_keeps_it() -> None:
    """torch's P2POp may name the peer as a rank of its group (``group_peer``, ``peer`` None): the
    staged op keeps that, with the group."""
    posted, post = _recorder()
    p2p = HostStagedP2P(copy_staging(is_host=lambda t: False), post=post)
    group = object()
    op = _Op(dist.isend, torch.ones(2), peer=None, group=group, tag=5, group_peer=1)  # built by hand: no process group here
    p2p.batch_isend_irecv([op])
    (sent,) = posted
    assert (sent.peer, sent.group_peer, sent.group, sent.tag) == (None, 1, group, 5) and sent.tensor is not op.tensor


def test_the_gloo_double_refuses_what_gloo_cannot_move() -> None:
    host = staged_backend.HostBuffers()
    post = staged_backend.gloo_p2p_double(host)
    with pytest.raises(RuntimeError, match="gloo send/recv: a tensor in device memory"):
        post([dist.P2POp(dist.isend, torch.zeros(2), 1)])
    buf = host.empty_like(torch.zeros(2))
    assert host.holds(buf) and not host.holds(buf.clone()) and host.made == 1


def _model_config(name: str, **extra: Any) -> dict[str, Any]:
    mb = 4 if name in ("dualpipe", "dualpipev") else 2
    raw: dict[str, Any] = {
        "backend": staged_backend.NAME,
        "parallel": {"pp": 2, "ep": 2, "dp": 1},
        "schedule": {"name": name, "microbatches": mb},
        "model": {"vocab_size": 32, "hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32,
                  "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 8},
        "train": {"micro_batch_size": 2, "seed": 5, "grad_bucket_mb": 0.01},
    }
    for section, values in extra.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from portapipe.config import load_config
    from portapipe.ranks.launch import LaunchError
    from portapipe.verify import verify_many

    raws = json.loads(open(sys.argv[1]).read())
    for report in verify_many([load_config(raw) for raw in raws[:-1]]):
        print("REPORT", json.dumps(report.summary()), flush=True)
    try:
        verify_many([load_config(raws[-1])])
        print("UNSTAGED passed", flush=True)
    except LaunchError as err:
        print("UNSTAGED", " ".join(str(err).split()), flush=True)
    """
)


@pytest.mark.multiproc
@pytest.mark.slow
def test_every_schedule_verifies_exactly_at_pp2_ep2_through_staged_p2p(tmp_path: Path) -> None:
    """Every schedule, pp 2 x ep 2, four gloo ranks whose point-to-point the double allows only
    through host buffers: the pipelined step equals one process (float64, exact); so do DualPipeV
    with EPLB, interleaved with LPLB and 1F1B with ZeRO 2. Without the staging, the double refuses."""
    env = staged_backend.install(tmp_path / "site")
    raws = [_model_config(name) for name in SCHEDULES]
    raws.append(_model_config("dualpipev", balancer={"kind": "eplb", "redundant": 1}))
    raws.append(_model_config("interleaved", balancer={"kind": "lplb", "topology": "ring", "redundant": 1}))
    raws.append(_model_config("1f1b", train={"zero_stage": 2}))
    raws.append(_model_config("1f1b", backend_options={"staging": "off"}))
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(raws))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    reports = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("REPORT ")]
    assert [(r["schedule"], r["pp"], r["ep"]) for r in reports] == [(raw["schedule"]["name"], 2, 2) for raw in raws[:-1]]
    bad = [r for r in reports if not (r["ok"] and r["loss_diff"] == 0.0 and r["precision"] == "float64")]
    assert not bad, bad
    unstaged = [line for line in lines if line.startswith("UNSTAGED")]
    assert len(unstaged) == 1 and staged_backend.REFUSAL in unstaged[0], proc.stdout[-2000:]
