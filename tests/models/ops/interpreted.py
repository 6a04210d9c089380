"""Running Triton kernels under Triton's interpreter on the CPU, for the `test_*_interpreted.py` files.

TRITON_INTERPRET must be set before triton is imported, so each file runs its script once in a subprocess, which
prints one JSON object of results on its last line."""

import json
import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(script: str, cases: list) -> dict:
    """`script` run with the JSON of `cases` as its one argument under the interpreter -> its last line's JSON."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])
