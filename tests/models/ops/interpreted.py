"""Running Triton kernels under Triton's interpreter on the CPU, for the `test_*_interpreted.py` files.

TRITON_INTERPRET must be set before triton is imported, so each file runs its script once in a subprocess, which
prints one JSON object of results on its last line. Where the installed Triton's interpreter cannot run under the
installed numpy (`interpreter_refusal`), the tests skip with that reason."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def interpreter_refusal() -> str | None:
    """Why Triton's interpreter cannot run kernels here, or None. Triton 3.6's interpreter converts one-element
    arrays to Python scalars, which numpy 2.4 turned from a deprecation into a TypeError ("only 0-dimensional arrays
    can be converted to Python scalars"; seen on the lent GPUs: triton 3.6.0, numpy 2.5.2); triton 3.7.1 and 3.9.0
    run it under numpy 2.4."""
    import numpy
    import triton
    from packaging.version import Version

    if Version(triton.__version__) < Version("3.7.1") and Version(numpy.__version__) >= Version("2.4"):
        return (f"triton {triton.__version__}'s interpreter converts one-element arrays to Python scalars, which "
                f"numpy {numpy.__version__} (>= 2.4) refuses; needs triton >= 3.7.1 or numpy < 2.4")
    return None


def run_under_interpreter(args: list[str], timeout: int) -> dict:
    """`python ARGS` in a fresh process under the interpreter, from the repository root (first on the path, before
    any PYTHONPATH already set) -> its last line's JSON; skips the calling test where the interpreter cannot run
    (`interpreter_refusal`)."""
    if reason := interpreter_refusal():
        pytest.skip(reason)
    root = Path(__file__).resolve().parents[3]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_interpreted(script: str, cases: list) -> dict:
    """`script` run with the JSON of `cases` as its one argument under the interpreter -> its last line's JSON."""
    return run_under_interpreter(["-c", script, json.dumps(cases)], timeout=600)
