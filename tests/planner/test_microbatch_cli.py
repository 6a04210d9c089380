"""`python -m planner batches`: JSON of item 6 and errors."""

import json

from planner.__main__ import main
from planner.jsonl import read_jsonl
from planner.microbatch import MicrobatchPlan, PlannedMicrobatch
from planner.pack import pack
from tests.planner.test_microbatch import check_plan

WALKTHROUGH = '{"tokens":[1,2,3,4]}\n{"tokens":[1,2,3,5]}\n\n{"tokens":[1,2,6,7]}\n{"tokens":[9,9]}\n'


def test_batches_json(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text(WALKTHROUGH)
    assert main(["batches", str(path), "--capacity", "6", "--dp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"microbatches", "total_compact_tokens", "planning_seconds"}
    plan = MicrobatchPlan(
        tuple(PlannedMicrobatch(tuple(m["trajectories"]), m["replica"], m["slot"], m["compact_tokens"])
              for m in out["microbatches"]), 2, 6, out["planning_seconds"], "cli")
    trajectories = read_jsonl(path)
    check_plan(plan, trajectories, 6, 2)
    # The trie (9 tokens) exceeds 6; the best even split is {0, 1} (5 tokens) and {2, 3} (4 + 2).
    assert out["total_compact_tokens"] == 11 and pack(trajectories).num_compact == 9


def test_batches_table_and_errors(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text(WALKTHROUGH)
    assert main(["batches", str(path), "--capacity", "6", "--dp", "2"]) == 0
    assert "microbatches on 2 replicas" in capsys.readouterr().out
    assert main(["batches", str(path), "--capacity", "3", "--dp", "1"]) == 2
    assert "trajectory 0 has 4 tokens but capacity is 3" in capsys.readouterr().err
    assert main(["batches", str(path), "--capacity", "6", "--dp", "0"]) == 2
    assert "`dp` must be >= 1, got 0" in capsys.readouterr().err
