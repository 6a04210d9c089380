"""bench.fidelity end to end on CPU in float64: generated and user-given trajectories, both model families."""

import json

import numpy as np
import pytest

from bench.branching import nested_fork_trajectories
from bench.fidelity import main
from planner.jsonl import write_jsonl


def run(capsys, *args):
    assert main([*args, "--dtype", "float64", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_generated_trees(capsys, model):
    r = run(capsys, "--model", model, "--depth", "5", "--tail", "16", "--chunk-size", "32")
    assert r["max_handoff_depth"] >= 5 and r["num_rounds"] >= 2 and r["total_replay"] > 0
    assert r["logprob_max_abs_diff"] <= 1e-10
    assert r["grad_max_rel_diff"] <= 1e-10
    assert r["loss_abs_diff"] <= 1e-10 and r["moe_aux_abs_diff"] <= 1e-10
    assert r["mean_logit_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert set(r["symkl_by_depth"]) == {str(d) for d in range(r["max_handoff_depth"] + 1)}
    assert r["no_replay"]["logprob_max_abs_diff"] <= 1e-10  # float64: the ablation only changes rounding
    assert r["flat_repacked"]["logprob_max_abs_diff"] <= 1e-10


def test_float32_against_float64_oracle_and_per_layer(capsys):
    """The oracle column: each float32 execution against the same weights run in float64; the per-layer table."""
    assert main(["--model", "tiny-kimi-linear", "--depth", "3", "--tail", "16", "--chunk-size", "32",
                 "--dtype", "float32", "--oracle", "--per-layer", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    layers = r["per_layer_not_bitwise"]
    assert [row["layer"] for row in layers] == list(range(4)) and layers[3]["type"] == "full_attention"
    assert all(set(row["arbor"]) == {str(d) for d in range(r["max_handoff_depth"] + 1)} for row in layers)
    assert any(v > 0 for v in layers[-1]["arbor"].values())  # float32 on CPU: rounding differs somewhere
    for name in ("flat", "arbor", "flat_repacked"):
        o = r["vs_float64"][name]
        assert 0 < o["logprob_max_abs_diff"] < 1e-4, name  # float32 rounding: present, and small
        assert o["grad_max_rel_diff"] is None  # the float64 run is forward only
        assert o["mean_logit_cosine"] > 1 - 1e-9
    with pytest.raises(SystemExit):
        main(["--dtype", "float64", "--oracle"])
    assert "--oracle compares against float64" in capsys.readouterr().err


def test_user_trajectories_and_recompute(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_jsonl(nested_fork_trajectories(np.random.default_rng(1), 32, 1024, depth=3, tail=20, trees=2), path)
    r = run(capsys, "--model", "tiny-kimi-linear", "--trajectories", str(path), "--chunk-size", "32", "--recompute")
    assert r["recompute"] == "full" and r["trajectories"] == str(path)
    assert r["logprob_max_abs_diff"] <= 1e-10 and r["grad_max_rel_diff"] <= 1e-10


def test_token_outside_vocabulary(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text('{"tokens": [1, 2, 5000]}\n')
    assert main(["--model", "tiny-qwen3-next", "--trajectories", str(path)]) == 2
    assert "vocab_size" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_carry_mode_splits_the_tree_and_matches(capsys, model):
    """--mode carry: the tree (384 rows) over microbatches of at most 100 rows, against trajectory-wise execution."""
    r = run(capsys, "--model", model, "--depth", "5", "--tail", "16", "--chunk-size", "32", "--mode", "carry",
            "--capacity", "100", "--recompute")
    c = r["carry"]
    assert r["mode"] == "carry" and c["microbatches"] >= 3 and c["max_context_rows"] > 0
    assert c["executed_rows"] == c["trie_rows"] == r["compact_tokens"]
    assert r["logprob_max_abs_diff"] < 1e-10 and r["loss_abs_diff"] < 1e-10
    assert r["grad_max_rel_diff"] < 1e-10 and r["moe_aux_abs_diff"] < 1e-10
    assert r["mean_logit_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert r["arbor"]["logprob_max_abs_diff"] < 1e-10  # the single-microbatch run stays a column


def test_carry_mode_needs_a_capacity(capsys):
    with pytest.raises(SystemExit):
        main(["--mode", "carry"])
    assert "--mode carry needs --capacity" in capsys.readouterr().err
