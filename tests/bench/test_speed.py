"""bench.speed end to end on CPU with a tiny model: both workloads, both modes, the fitted cost model and auto mode."""

import json

from bench.speed import main


def test_speed_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert main(["--model", "tiny-kimi-linear", "--dtype", "float32", "--device", "cpu", "--scale", "0.002",
                 "--token-scale", "0.02", "--capacity", "4096", "--low-paths", "4", "--low-length", "256",
                 "--warmup", "0", "--repeat", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "F/B/G x" in printed and "swe: tokens/s flat" in printed
    swe, low = r["results"]
    assert swe["workload"] == "swe" and low["workload"] == "low-share"
    assert swe["compression"] > low["compression"] > 1.0
    for w in (swe, low):
        assert w["semantic_tokens"] > w["compact_tokens"] and w["attention_view_rows"] >= w["compact_tokens"]
        assert w["flat"]["seconds"] > 0 and w["tree"]["seconds"] > 0 and w["auto"]["seconds"] > 0
        assert w["fbg_speedup"] == w["flat"]["seconds"] / w["tree"]["seconds"]
        assert w["auto"]["tree_microbatches"] + w["auto"]["flat_microbatches"] >= 1
    assert set(r["header"]["cost_model"]) == {"flat_per_token", "tree_per_compact", "tree_per_view_row"}
