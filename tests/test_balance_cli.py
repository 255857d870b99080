"""``portapipe balance``: every loads format, text and JSON output, errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from portapipe.balancing.eplb import balancedness, lower_bound, rebalance_experts
from portapipe.cli import main

W = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
ARGS = ["--replicas", "16", "--groups", "4", "--nodes", "2", "--gpus", "8"]


def write_all_formats(tmp: Path) -> list[Path]:
    torch.save(torch.tensor(W), tmp / "a.pt")
    torch.save({"loads": torch.tensor(W, dtype=torch.float64)}, tmp / "b.pt")
    (tmp / "c.json").write_text(json.dumps(W))
    (tmp / "d.json").write_text(json.dumps({"loads": W}))
    (tmp / "e.csv").write_text(",".join(f"e{i}" for i in range(12)) + "\n" + "\n".join(",".join(map(str, r)) for r in W) + "\n")
    (tmp / "f.csv").write_text("\n".join(", ".join(map(str, r)) for r in W))
    return sorted(tmp.iterdir())


def test_every_format_gives_the_published_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = rebalance_experts(torch.tensor(W), 16, 4, 2, 8)
    for path in write_all_formats(tmp_path):
        assert main(["balance", "--loads", str(path), *ARGS, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["phy2log"] == want[0].tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                                       [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]], path.name
        assert out["logcnt"] == want[2].tolist() and out["log2phy"] == want[1].tolist()
        assert out["balancedness"] == pytest.approx(balancedness(torch.tensor(W), want[0], 8).tolist())
        assert out["lower_bound"] == pytest.approx(lower_bound(torch.tensor(W), 16, 8).tolist())


def test_text_output_and_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_all_formats(tmp_path)[0]
    assert main(["balance", "--loads", str(path), *ARGS, "--policy", "refined"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("policy refined: 2 layers x 12 experts -> 16 slots on 8 GPUs (2 per GPU)")
    assert text.count("GPU 7: experts") == 2 and "lower bound 129.125" in text
    refined = rebalance_experts(torch.tensor(W), 16, 4, 2, 8, policy="refined")[0]
    assert f"GPU 0: experts {refined[0, :2].tolist()}" in text
    # the refined plan's worst GPU is no worse than the published one's, layer by layer
    hier = [float(x) for x in balancedness(torch.tensor(W), rebalance_experts(torch.tensor(W), 16, 4, 2, 8)[0], 8)]
    ref = [float(x) for x in balancedness(torch.tensor(W), refined, 8)]
    assert all(r >= h for r, h in zip(ref, hier))


@pytest.mark.parametrize(
    "content, name, extra, message",
    [
        (None, "missing.json", [], "does not exist"),
        ("[[1, 2]]", "x.txt", [], "unknown loads format '.txt'"),
        ('{"load": [[1]]}', "x.json", [], "needs the key 'loads'"),
        ("1,2,nan,4,5,6,7,8,9,10,11,12", "x.csv", [], "NaN value(s), first at layer 0 expert 2"),
        ("1,2,-3,4,5,6,7,8,9,10,11,12", "x.csv", [], "negative value(s), first at layer 0 expert 2"),
        ("[[1, 2], [3]]", "x.json", [], "cannot read loads"),
        (json.dumps(W), "x.json", ["--gpus", "6"], "16 % 6"),
    ],
)
def test_bad_input_exits_2_with_a_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None,
                                         name: str, extra: list[str], message: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    args = ARGS[:-2] + (extra or ARGS[-2:])
    assert main(["balance", "--loads", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portapipe balance: ") and message in err
