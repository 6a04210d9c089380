"""`python -m planner calls` (planner/commands/calls.py) on both input kinds, and its errors."""

import json

import pytest

from planner.__main__ import main
from planner.jsonl import write_jsonl
from planner.trajectory import Trajectory

FIGURE_2A = {
    "nodes": [
        {"id": "v0", "parent": None, "tokens": 63},
        {"id": "v1", "parent": "v0", "tokens": 2},
        {"id": "v2", "parent": "v0", "tokens": 10},
        {"id": "v3", "parent": "v1", "tokens": 5},
        {"id": "v4", "parent": "v1", "tokens": 7},
    ]
}


def run_cli(capsys, *argv):
    code = main(["calls", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, obj, name="tree.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj, indent=1))
    return path


def test_segment_json(tmp_path, capsys):
    code, out, _ = run_cli(capsys, write(tmp_path, FIGURE_2A), "--json")
    assert code == 0
    assert json.loads(out) == {
        "num_rounds": 2,
        "total_replay": 64,
        "rounds": [
            {"round": 1, "replay": 63, "sequences": [
                {"segments": ["v0", "v1", "v3"], "replay": 0, "anchor": 0},
                {"segments": ["v2"], "replay": 63, "anchor": 0},
            ]},
            {"round": 2, "replay": 1, "sequences": [{"segments": ["v4"], "replay": 1, "anchor": 64}]},
        ],
    }
    code, out, _ = run_cli(capsys, write(tmp_path, FIGURE_2A), "--chunk-size", 8)
    assert code == 0 and "rounds       2" in out and "replay R     8" in out and "v0 -> v1 -> v3" in out


def test_traj_jsonl(tmp_path, capsys):
    base = list(range(100, 170))
    path = tmp_path / "traj.jsonl"
    write_jsonl([Trajectory(base), Trajectory(base[:65] + [1, 2]), Trajectory(base[:30] + [3])], path)
    code, out, _ = run_cli(capsys, path, "--json")
    assert code == 0
    result = json.loads(out)
    # Segments in trie (lexicographic) preorder: 0 = [0, 30); at the fork at 30 token 3 sorts first: 1 = [30, 31),
    # 2 = [30, 65); at 65 tokens 1, 2 sort first: 3 = [65, 67), 4 = [65, 70). The root fits its entry chunk, so
    # segment 2 joins round 1 from the zero state; the fork at 65 >= B waits for the state at 64.
    assert result["num_rounds"] == 2 and result["total_replay"] == 30 + 1
    assert result["rounds"][0]["sequences"] == [
        {"segments": [0, 1], "replay": 0, "anchor": 0},
        {"segments": [2, 3], "replay": 30, "anchor": 0},
    ]
    assert result["rounds"][1]["sequences"] == [{"segments": [4], "replay": 1, "anchor": 64}]
    code, out, _ = run_cli(capsys, path)
    assert code == 0 and "TRAJ.jsonl, 3 trajectories, 73 compact rows, 5 segments" in out


def node(nid, parent, tokens):
    return {"id": nid, "parent": parent, "tokens": tokens}


@pytest.mark.parametrize(
    "nodes, message",
    [
        ([node("R", None, 3), node("A", "B", 1), node("B", "A", 2)], "cycle"),
        ([node("R", "R", 3)], "no root"),
        ([node("R", None, 3), node("A", "X", 1)], "unknown parent 'X'"),
        ([node("R", None, 3), node("A", ["R"], 1)], "unknown parent ['R']"),
        ([node("R", None, 3), node("S", None, 1)], "two roots 'R' and 'S'"),
        ([node("R", None, 3), node("A", "R", 0)], "tokens must be an integer >= 1, got 0"),
        ([node("R", None, 3), node("A", "R", 1.5)], "tokens must be an integer >= 1, got 1.5"),
        ([node("R", None, 3), node("R", "R", 1)], "duplicate id 'R'"),
        ([node("R", None, 3), {"id": "A", "parent": "R"}], 'exactly the keys "id", "parent", "tokens"'),
        ([], "non-empty list"),
    ],
    ids=["cycle", "self-parent", "unknown-parent", "list-parent", "two-roots", "zero-tokens", "float-tokens",
         "duplicate-id", "missing-key", "empty"],
)
def test_invalid_segment_json(tmp_path, capsys, nodes, message):
    code, out, err = run_cli(capsys, write(tmp_path, {"nodes": nodes}))
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_other_errors(tmp_path, capsys):
    code, _, err = run_cli(capsys, write(tmp_path, FIGURE_2A), "--chunk-size", 0)
    assert code == 2 and "`chunk_size` must be a positive integer, got 0" in err
    code, _, err = run_cli(capsys, tmp_path / "missing.json")
    assert code == 2 and "no such file" in err
    (tmp_path / "bad.jsonl").write_text('{"tokens": [1, 2]}\n{"tokens": [3\n')
    code, _, err = run_cli(capsys, tmp_path / "bad.jsonl")
    assert code == 2 and "bad.jsonl:2: invalid JSON" in err
