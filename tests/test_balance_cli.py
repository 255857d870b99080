"""``portapipe balance``: every loads format, the default policy, the cost comparison, one groups/nodes
rule shared with the config, and errors with exit code 2 (one line each, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from portapipe.balancing.cost import migration_cost, slot_bytes
from portapipe.balancing.eplb import balancedness, gpu_loads, lower_bound, rebalance_experts
from portapipe.cli import main
from portapipe.config import ConfigError, load_config

W = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
ARGS = ["--replicas", "16", "--groups", "4", "--nodes", "2", "--gpus", "8"]
PUBLISHED = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1], [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "expert_loads.txt"


def write_all_formats(tmp: Path) -> list[Path]:
    torch.save(torch.tensor(W), tmp / "a.pt")
    torch.save({"loads": torch.tensor(W, dtype=torch.float64)}, tmp / "b.pt")
    (tmp / "c.json").write_text(json.dumps(W))
    (tmp / "d.json").write_text(json.dumps({"loads": W}))
    (tmp / "e.csv").write_text(",".join(f"e{i}" for i in range(12)) + "\n" + "\n".join(",".join(map(str, r)) for r in W) + "\n")
    (tmp / "f.csv").write_text("\n".join(", ".join(map(str, r)) for r in W))
    (tmp / "g.txt").write_text("# a comment\n\n" + "\n".join("  ".join(map(str, r)) + "  # layer" for r in W) + "\n")
    (tmp / "h.txt").write_text("\n".join("\t".join(map(str, r[:6])) + " , " + ",".join(map(str, r[6:])) for r in W))
    return sorted(tmp.iterdir())


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["balance", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_format_and_the_shipped_example_give_the_published_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = rebalance_experts(torch.tensor(W), 16, 4, 2, 8)
    for path in [*write_all_formats(tmp_path), EXAMPLE]:
        out = run_json(capsys, "--loads", str(path), *ARGS, "--policy", "hierarchical")
        assert out["phy2log"] == want[0].tolist() == PUBLISHED, path.name
        assert out["logcnt"] == want[2].tolist() and out["log2phy"] == want[1].tolist()
        assert out["balancedness"] == pytest.approx(balancedness(torch.tensor(W), want[0], 8).tolist())
        assert out["lower_bound"] == pytest.approx(lower_bound(torch.tensor(W), 16, 8).tolist())
        assert out["ran"] == "hierarchical"


def test_default_is_trainings_policy_refined_first_then_incremental(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loads = write_all_formats(tmp_path)[2]
    first = run_json(capsys, "--loads", str(loads), *ARGS)
    assert first["policy"] == "incremental" and first["ran"].startswith("refined (the first placement")
    assert first["phy2log"] == rebalance_experts(torch.tensor(W), 16, 4, 2, 8, policy="refined")[0].tolist()
    # a later rebalance, as in training: from the placement in force, on drifted loads
    (tmp_path / "current.json").write_text(json.dumps(first))
    drifted = torch.tensor(W, dtype=torch.float64) * torch.tensor([[1.3] * 6 + [0.8] * 6, [0.7] * 6 + [1.2] * 6])
    (tmp_path / "drifted.json").write_text(json.dumps(drifted.tolist()))
    later = run_json(capsys, "--loads", str(tmp_path / "drifted.json"), *ARGS, "--current", str(tmp_path / "current.json"),
                     "--max-moved", "0.25")
    want = rebalance_experts(drifted, 16, 4, 2, 8, policy="incremental", current=torch.tensor(first["phy2log"]), max_moved=0.25)
    assert later["ran"] == "incremental" and later["phy2log"] == want[0].tolist()
    assert later["compare"]["incremental"]["slots_changed"] == int((want[0] != torch.tensor(first["phy2log"])).sum()) <= 2 * 4
    # a run's expert_loads.json records the placement in force beside the loads: one file serves both
    run_file = tmp_path / "expert_loads.json"
    run_file.write_text(json.dumps({"step": 100, "window": 10, "layers": [1, 2], "loads": drifted.tolist(), "phy2log": first["phy2log"]}))
    again = run_json(capsys, "--loads", str(run_file), *ARGS, "--current", str(run_file), "--max-moved", "0.25")
    assert again["phy2log"] == later["phy2log"]


def test_compare_prints_slots_bytes_and_balance_of_every_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loads = write_all_formats(tmp_path)[2]
    out = run_json(capsys, "--loads", str(loads), *ARGS, "--expert-params", "1000", "--dtype", "float32", "--optimizer", "adamw")
    per_slot = slot_bytes(1000, "float32", "adamw")
    assert out["bytes_per_slot"] == per_slot == 1000 * 3 * 4
    w, identity = torch.tensor(W), torch.arange(16).remainder(12).expand(2, 16)
    for policy in ("hierarchical", "global", "refined"):
        row = out["compare"][policy]
        plan = rebalance_experts(w, 16, 4, 2, 8, policy=policy)[0]
        cost = migration_cost(identity, plan, 8, 2)
        assert row["slots_changed"] == int(cost.changed.sum()) > 0
        assert (row["bytes_intra_node"], row["bytes_inter_node"]) == (int(cost.intra.sum()) * per_slot, int(cost.inter.sum()) * per_slot)
        loads_ = gpu_loads(w, plan, 8)
        assert row["max_over_mean_after"] == pytest.approx(float((loads_.max(1).values / loads_.mean(1)).mean()))
    keep = out["compare"]["keep"]
    assert keep["slots_changed"] == keep["bytes"] == 0 and keep["max_over_mean_after"] == keep["max_over_mean_before"]
    text = main(["balance", "--loads", str(loads), *ARGS]), capsys.readouterr().out
    assert text[0] == 0 and "slots changed" in text[1] and "moved in node" in text[1] and "across nodes" in text[1]
    assert "hierarchical" in text[1] and "incremental>refined" in text[1] and "264.2 MB per slot" in text[1]


def _balance_rc(tmp: Path, capsys: pytest.CaptureFixture[str], experts: int, groups: int, nodes: int, gpus: int) -> tuple[int, str]:
    path = tmp / f"w{experts}.json"
    path.write_text(json.dumps([[float(i + 1) for i in range(experts)]]))
    rc = main(["balance", "--loads", str(path), "--replicas", str(experts + gpus), "--groups", str(groups), "--nodes", str(nodes),
               "--gpus", str(gpus), "--policy", "hierarchical", "--json"])
    cap = capsys.readouterr()
    return rc, cap.err if rc else json.loads(cap.out)["ran"]


def _config_ok(experts: int, groups: int, nodes: int, gpus: int) -> bool:
    raw = {"backend": "cpu", "parallel": {"pp": 1, "ep": gpus, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
           "model": {"n_layers": 2, "n_dense": 1, "n_experts": experts, "top_k": 1},
           "balancer": {"kind": "eplb", "groups": groups, "nodes": nodes, "redundant": 1, "policy": "hierarchical"}}
    try:
        load_config(raw)
        return True
    except ConfigError as err:
        assert all(line.startswith(("balancer.groups", "balancer.nodes")) for line in err.problems), err.problems
        return False


@pytest.mark.parametrize(
    "experts, groups, nodes, gpus, expect",
    [
        (8, 3, 1, 4, "--groups 3 does not divide the 8 experts"),  # refused with one node ...
        (8, 3, 2, 4, "--groups 3 does not divide the 8 experts"),  # ... and with two (it used to fall back silently)
        (8, 4, 3, 4, "--nodes 3 does not divide --gpus 4"),
        (12, 3, 2, 4, "global (hierarchical needs --groups % --nodes == 0: 3 % 2 = 1)"),  # runs, labelled as what ran
        (12, 4, 2, 4, "hierarchical"),
    ],
)
def test_one_groups_nodes_rule_for_the_cli_and_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], experts: int,
                                                          groups: int, nodes: int, gpus: int, expect: str) -> None:
    rc, said = _balance_rc(tmp_path, capsys, experts, groups, nodes, gpus)
    assert (rc == 0) == _config_ok(experts, groups, nodes, gpus)
    if rc:
        assert rc == 2 and said == f"portapipe balance: {expect}\n" and "Traceback" not in said
    else:
        assert said == expect


@pytest.mark.parametrize(
    "content, name, extra, message",
    [
        (None, "missing.json", [], "does not exist"),
        ("[[1, 2]]", "x.yaml", [], "unknown loads format '.yaml'"),
        ('{"load": [[1]]}', "x.json", [], "needs the key 'loads'"),
        ("1,2,nan,4,5,6,7,8,9,10,11,12", "x.csv", [], "NaN value(s), first at layer 0 expert 2"),
        ("1,2,-3,4,5,6,7,8,9,10,11,12", "x.csv", [], "negative value(s), first at layer 0 expert 2"),
        ("1 2 3 4 5 6 7 8 9 10 11 12\n1 2 x 4 5 6 7 8 9 10 11 12", "x.txt", [], "line 2: 'x' is not a number"),
        ("1 2 3 4 5 6 7 8 9 10 11 12\n1 2 3", "x.txt", [], "rows have different lengths: [3, 12]"),
        (b"\x80\x81\xfe\xff" * 8, "x.csv", [], "not UTF-8 text"),
        (b"\x80\x81\xfe\xff" * 8, "x.pt", [], "cannot read loads"),
        ("[[1, 2], [3]]", "x.json", [], "cannot read loads"),
        ("", "x.txt", [], "x.txt: no numbers: the file is empty or holds only comments and a header"),
        ("# loads\n\n", "x.csv", [], "no numbers: the file is empty"),
        ("e0,e1,e2\n", "x.csv", [], "no numbers: the file is empty or holds only comments and a header"),
        ("1,2,3;4,5,6,7,8,9,10,11,12", "x.csv", [], "line 1: '3;4' is not a number"),  # not taken for a header
        ("0x10 2 3 4 5 6 7 8 9 10 11 12", "x.txt", [], "line 1: '0x10' is not a number"),
        ("1,,2,3,4,5,6,7,8,9,10,11,12", "x.csv", [], "line 1: empty field 2; every expert needs a number"),
        ("1, 2 3\t4,,5,6,7,8,9,10,11,12", "x.txt", [], "line 1: empty field 5"),  # mixed separators, one field missing
        ("1,2,3,4,5,6,7,8,9,10,11,12,", "x.csv", [], "line 1: empty field 13"),
        (",,,", "x.csv", [], "line 1: empty field 1"),
        ("[[true, false, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]", "x.json", [], "x.json: true is not a number"),
        ("1e39 2 3 4 5 6 7 8 9 10 11 12", "x.txt", [], "x.txt: load 1e+39 (layer 0 expert 0) is beyond float32's range"),
        ("1,2,nan,4,5,6,7,8,9,10,11,12", "named.csv", [], "named.csv: expert loads must be finite"),
        (json.dumps(W), "x.json", ["--gpus", "8", "--current", "@huge.json"], "huge.json: phy2log entries must lie in [0, 12); got [0, 1e+30]"),
        (json.dumps(W), "x.json", ["--gpus", "8", "--current", "@dup.json"], "dup.json: current puts two replicas of expert 0 on GPU 0"),
        (json.dumps(W), "x.json", ["--gpus", "6"], "--replicas 16 is not a multiple of --gpus 6"),
        (json.dumps(W), "x.json", ["--gpus", "8", "--max-moved", "1.5"], "--max-moved 1.5 is a fraction of the slots"),
        (json.dumps(W), "x.json", ["--gpus", "8", "--current", "@short.json"], "phy2log must be [layers, slots] = [2, 16], got [1, 3]"),
        (json.dumps(W), "x.json", ["--gpus", "8", "--current", "@dup.json"], "puts two replicas of expert 0 on GPU 0 (layer 0)"),
        (json.dumps(W), "x.json", ["--gpus", "8", "--current", "@unplaced.json"], "expert 1 of layer 0 has none"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes | None,
                                         name: str, extra: list[str], message: str) -> None:
    (tmp_path / "short.json").write_text("[[0, 1, 2]]")
    dup = [[0, 0] + list(range(1, 12)) + [1, 2, 3]] * 2  # GPU 0 holds expert 0 twice
    (tmp_path / "dup.json").write_text(json.dumps({"phy2log": dup}))
    (tmp_path / "unplaced.json").write_text(json.dumps([[0] * 16] * 2))
    (tmp_path / "huge.json").write_text(json.dumps([list(range(12)) + [0, 1, 2, 1e30]] * 2))  # would wrap as int64
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    args = ARGS[:-2] + (extra or ARGS[-2:])
    args = [str(tmp_path / a[1:]) if a.startswith("@") else a for a in args]
    assert main(["balance", "--loads", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portapipe balance: ") and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_bool_tensor_is_not_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save(torch.ones(2, 12, dtype=torch.bool), tmp_path / "b.pt")
    assert main(["balance", "--loads", str(tmp_path / "b.pt"), *ARGS]) == 2
    err = capsys.readouterr().err
    assert err == f"portapipe balance: {tmp_path / 'b.pt'}: a tensor of torch.bool is not a table of loads; save real numbers\n"
