import json

import pytest

from planner.__main__ import main
from planner.jsonl import TrajectoryFileError, read_jsonl

WALKTHROUGH = '{"tokens":[1,2,3,4]}\n{"tokens":[1,2,3,5]}\n{"tokens":[1,2,6,7]}\n'


def test_stats_walkthrough_json(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text(WALKTHROUGH)
    assert main(["stats", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compact_tokens"] == 7 and out["semantic_tokens"] == 12
    assert out["compression"] == pytest.approx(12 / 7)
    assert out["trajectories"] == 3 and out["segments"] == 5 and out["max_depth"] == 4


def test_stats_table(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text(WALKTHROUGH)
    assert main(["stats", str(path)]) == 0
    assert "compact_tokens   7" in capsys.readouterr().out


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ('{"tokens":[1,2]}\n{"tokens":[1,2\n', ":2: invalid JSON"),
        ('{"tokens":[]}\n', ":1: 'tokens' must be a non-empty list"),
        ('{"tokens":[1,2],"los_mask":[0,1]}\n', "did you mean 'loss_mask'"),
        ('{"tokens":[1,2],"loss_mask":[0]}\n', ":1: `loss_mask` must be a scalar or have one entry per token"),
        ('{"tokens":[1,-2]}\n', ":1: `tokens` must lie in"),
        ('{"tokens":[1,"a"]}\n', ":1: 'tokens' must be a non-empty list of integers"),
        ("[1,2]\n", ":1: expected a JSON object"),
    ],
)
def test_bad_files(tmp_path, capsys, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TrajectoryFileError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_jsonl(path)
    assert main(["stats", str(path)]) == 2
    assert message.split(":")[-1].strip()[:10] in capsys.readouterr().err


def test_missing_file(tmp_path):
    with pytest.raises(TrajectoryFileError, match="no such file"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_write_read_round_trip(tmp_path):
    from planner.jsonl import write_jsonl
    from planner.trajectory import Trajectory

    trajs = [
        Trajectory([5, 6, 7], loss_mask=[0, 1, 1], advantage=[0.5, -1.0, 2.0], logprobs=[0, -0.1, -0.2], tree="a"),
        Trajectory([5, 8], advantage=1.5, weight=2.0, reward=1.0),
    ]
    write_jsonl(trajs, tmp_path / "t.jsonl")
    back = read_jsonl(tmp_path / "t.jsonl")
    for a, b in zip(trajs, back):
        assert a.tokens.tolist() == b.tokens.tolist() and (a.loss_mask == b.loss_mask).all()
        assert (a.advantage == b.advantage).all() and a.weight == b.weight and a.tree == b.tree
    assert back[0].logprobs.tolist() == [0, -0.1, -0.2] and back[1].reward == 1.0
