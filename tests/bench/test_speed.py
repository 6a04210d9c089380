"""bench.speed end to end on CPU with a tiny model: both workloads, all three modes, the fitted cost model and auto
mode; `--modes` skipping the duplicate plan on a step whose tree carry splits over microbatches."""

import argparse
import json

import pytest

from bench.speed import carry_context_cost, main, mfu_text, print_run_summary, run_variants


def test_speed_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["--model", "tiny-kimi-linear", "--dtype", "float32", "--device", "cpu", "--scale", "0.002",
                 "--token-scale", "0.02", "--capacity", "4096", "--low-paths", "4", "--low-length", "256",
                 "--warmup", "0", "--repeat", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "F/B/G x" in printed and "carry x" in printed and "swe: tokens/s flat" in printed
    swe, low = r["results"]
    assert swe["workload"] == "swe" and low["workload"] == "low-share"
    assert swe["compression"] > low["compression"] > 1.0
    for w in (swe, low):
        assert w["semantic_tokens"] > w["compact_tokens"] and w["attention_view_rows"] >= w["compact_tokens"]
        assert w["flat"]["seconds"] > 0 and w["tree"]["seconds"] > 0 and w["auto"]["seconds"] > 0
        assert w["fbg_speedup"] == w["flat"]["seconds"] / w["tree"]["seconds"]
        assert w["auto"]["tree_microbatches"] + w["auto"]["flat_microbatches"] == w["auto"]["of"] >= 1
        # Every tree fits in one microbatch here: carry executes the trie, as the duplicate plan does.
        assert w["carry"]["executed_rows"] == w["carry"]["trie_rows"] == w["compact_tokens"]
        assert w["carry_speedup"] == w["flat"]["seconds"] / w["carry"]["seconds"]
    (cost,) = r["header"]["cost_model"]  # one per --recompute option
    assert set(cost) == {"expansion_per_token", "tree_per_compact", "tree_per_view_row"}  # no context carried
    for w in (swe, low):
        assert w["expansion"]["seconds"] > 0 and w["expansion"]["tokens"] <= 4096
    assert "as a flat expansion through the tree path" in printed


def test_carry_context_cost_is_the_time_beyond_rows_and_views():
    """H200 numbers of one carry step: a refit of 65.1 us/row + 1.83 us/view row predicts 9.477 s for carry's 111,505
    rows and 1,211,398 view rows; it took 9.85 s with 31,078 context rows."""
    samples = [(111_505, 1_211_398, 31_078, 9.85)]
    beyond = 9.85 - (65.1e-6 * 111_505 + 1.83e-6 * 1_211_398)
    assert carry_context_cost(samples, 65.1e-6, 1.83e-6) == pytest.approx(beyond / 31_078)
    assert carry_context_cost(samples, 80e-6, 1.83e-6) == 0.0  # faster than its rows predict: no cost, never negative
    assert carry_context_cost([(10, 20, 0, 1.0)], 0.0, 0.0) is None  # no context rows: nothing to fit


def test_modes_and_carry_splitting_a_tree(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["--model", "tiny-kimi-linear", "--dtype", "float32", "--device", "cpu", "--scale", "0.002",
                 "--token-scale", "0.8", "--capacity", "2048", "--low-paths", "0", "--modes", "carry,flat",
                 "--warmup", "0", "--repeat", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    (swe,) = r["results"]
    assert r["header"]["modes"] == ["flat", "carry"] and r["header"]["cost_model"] == [None]
    assert "tree" not in swe and "auto" not in swe
    carry = swe["carry"]
    assert carry["microbatches"] >= 2  # the tree is larger than the capacity
    assert carry["executed_rows"] == carry["trie_rows"] < swe["semantic_tokens"]
    assert swe["carry_speedup"] == swe["flat"]["seconds"] / carry["seconds"]
    printed = capsys.readouterr().out
    assert f"carry executes {carry['executed_rows']:,} rows in {carry['microbatches']} microbatches" in printed


def test_unknown_mode(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--modes", "flat,tree"])
    assert exit_.value.code == 2
    assert "name one or more of flat, duplicate, carry" in capsys.readouterr().err


def test_recompute_options_side_by_side(tmp_path, capsys):
    out = tmp_path / "speed.json"
    options = ["none", "selective:part=ffn,save=experts+mm", "selective:layers=linear_attention,every=2,save="]
    assert main(["--model", "tiny-kimi-linear", "--dtype", "float32", "--device", "cpu", "--scale", "0.002",
                 "--token-scale", "0.02", "--capacity", "4096", "--low-paths", "0", "--modes", "flat,duplicate",
                 "--no-auto", "--warmup", "0", "--repeat", "1", "--recompute", *options, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["header"]["recompute"] == options and r["header"]["cost_model"] == [None] * 3
    assert [row["recompute"] for row in r["results"]] == options
    assert all(row["flat"]["seconds"] > 0 and row["tree"]["seconds"] > 0 for row in r["results"])
    printed = capsys.readouterr().out
    assert "runs: seconds / peak GiB per mode" in printed
    for option in options:
        assert f"recompute {option}, attention" in printed and printed.count(f" recompute {option}\n") == 1


def _variant_args(**kw):
    return argparse.Namespace(**{"recompute": ["full"], "compare_rowwise": False, "reference_rowwise": False,
                                 "compare_attention": False, "attention_kernels": "flash", **kw})


@pytest.mark.parametrize("flags, runs", [
    ({"compare_rowwise": True}, [(False, "flash", "reference row-wise"), (True, "flash", "fused row-wise")]),
    ({"compare_attention": True}, [(True, "flash", "flash attention"), (True, "fa4", "fa4 attention")]),
])
def test_a_comparison_runs_each_option_with_one_kernel_choice_then_the_other(flags, runs):
    """--compare-rowwise: references, then fused; --compare-attention: flash, then fa4; each over every option."""
    want = [(text, fused, pair, f"recompute {text}, {label}")
            for fused, pair, label in runs for text in ("none", "full")]
    assert run_variants(_variant_args(recompute=["none", "full"], **flags)) == want


def test_without_a_comparison_one_run_per_option_with_the_chosen_kernels():
    assert run_variants(_variant_args()) == [("full", True, "flash", "recompute full")]
    assert run_variants(_variant_args(reference_rowwise=True)) == [("full", False, "flash", "recompute full")]
    assert run_variants(_variant_args(attention_kernels="fa4")) == [("full", True, "fa4", "recompute full")]


def test_compare_attention_prints_each_modes_time_ratio(capsys):
    def row(recompute, pair, flat, tree):
        return {"workload": "swe", "recompute": recompute, "fused_rowwise": True, "attention_kernels": pair,
                "run": f"recompute {recompute}, {pair} attention",
                "flat": {"seconds": flat, "peak_gib": 40.0}, "tree": {"seconds": tree, "peak_gib": 41.0}}

    print_run_summary([row("none", "flash", 16.0, 4.0), row("full", "flash", 18.0, 5.0),
                       row("none", "fa4", 12.8, 3.2), row("full", "fa4", 15.0, 4.0)])
    out = capsys.readouterr().out
    assert "swe: flash s / fa4 s: flat 1.25x, tree 1.25x (recompute none, fa4 attention)" in out
    assert "swe: flash s / fa4 s: flat 1.20x, tree 1.25x (recompute full, fa4 attention)" in out


@pytest.mark.parametrize("extra, message", [
    (["--device", "cpu"], "--compare-attention needs --device cuda and --dtype bfloat16"),
    (["--device", "cuda", "--dtype", "float32"], "--compare-attention needs --device cuda and --dtype bfloat16"),
    (["--device", "cuda", "--attention-kernels", "fa4"], "leave out --attention-kernels"),
])
def test_compare_attention_refuses_what_it_cannot_compare(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--compare-attention", *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--device", "cuda", "--reference-rowwise"], "leave out --reference-rowwise"),
    (["--device", "cpu"], "--compare-rowwise needs --device cuda"),
])
def test_compare_rowwise_refuses_what_it_cannot_compare(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--compare-rowwise", *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option, message", [
    ("some", "give none, full or selective"), ("selective:parts=ffn", "key among"),
    ("selective:every=x", "positive integer"), ("selective:save=flash", "`save` entries"),
    ("selective:every=2,every=3", "'every' twice"),
])
def test_bad_recompute_option(capsys, option, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--recompute", option])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_mfu_line_names_both_forms_for_the_modes_that_ran():
    """Run F's flat 6 N MFU with the references (bench/RESULTS.md), 0.094; the modes without an MFU (a CPU run)
    print nothing."""
    row = {"flat": {"mfu": 0.094, "mfu_attention": 0.161}, "tree": {"seconds": 1.0},
           "carry": {"mfu": 0.08, "mfu_attention": 0.2}}
    assert mfu_text(row) == ("; MFU flat 0.094, carry 0.080 (6 N per executed row), flat 0.161, carry 0.200 with "
                             "attention's products")
    assert mfu_text({"flat": {"seconds": 2.0}}) == ""
