"""bench.weight_sync on the CPU (its own process: it starts a world of one): both paths move the whole model into
the receiving engine, the bucketed path without the host copy the file path makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_both_paths_on_cpu():
    done = subprocess.run(
        [sys.executable, "-m", "bench.weight_sync", "--model", "tiny-kimi-linear", "--device", "cpu", "--dtype",
         "float32", "--bucket-mb", "1", "--repeat", "1", "--copy-mb", "8", "--json"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    bucketed, file = report["results"]
    assert bucketed["path"] == "bucketed" and file["path"] == "file"
    assert bucketed["bytes"] == file["bytes"] == report["model_bytes"]
    assert file["host_peak_bytes"] >= report["model_bytes"]
    assert bucketed["host_peak_bytes"] <= report["bucket_bytes"] + 3 * report["largest_entry_bytes"]
    assert report["command"].startswith("python -m bench.weight_sync --model tiny-kimi-linear")
