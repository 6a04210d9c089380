"""`python -m planner batches`: JSON of item 6 and errors."""

import json

from planner.__main__ import main
from planner.jsonl import read_jsonl
from planner.microbatch.plan import MicrobatchPlan, PlannedMicrobatch
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


def test_batches_carry_json_and_table(tmp_path, capsys):
    """--mode carry: executed rows next to the trie's, the context bound and the slot imbalance; a path longer than
    the capacity plans (duplicate mode refuses it)."""
    path = tmp_path / "w.jsonl"
    path.write_text(WALKTHROUGH + '{"tokens":[1,2,3,4,5,6,7,8,9,10]}\n')
    assert main(["batches", str(path), "--capacity", "6", "--dp", "2", "--mode", "carry", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    trie = pack(read_jsonl(path)).num_compact
    assert out["trie_compact_tokens"] == out["total_compact_tokens"] == trie
    assert out["total_compact_tokens"] == sum(m["compact_tokens"] for m in out["microbatches"])
    assert out["max_context_rows"] >= 6 and out["max_open_microbatches"] >= 2
    assert set(out["slot_imbalance"]) == {"p50", "p95", "max"}
    assert len({tuple(k for k, _ in events) for events in out["events"]}) == 1
    assert main(["batches", str(path), "--capacity", "6", "--dp", "2", "--mode", "carry"]) == 0
    table = capsys.readouterr().out
    assert f"executed rows for {trie} trie rows" in table and "microbatches open" in table
    assert main(["batches", str(path), "--capacity", "6", "--dp", "2"]) == 2
    assert "has 10 tokens but capacity is 6" in capsys.readouterr().err
