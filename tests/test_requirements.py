"""The GPU stack's pins (requirements/gpu.txt, the `gpu` extra of pyproject.toml) agree with each other and resolve
together: pip's resolver in dry-run mode (no download of the wheels, no GPU needed; about a minute, and it needs the
package index: without it the test skips, naming why)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def pins(lines) -> dict[str, Requirement]:
    requirements = [Requirement(line) for line in (l.split("#")[0].strip() for l in lines) if line]
    return {r.name.lower(): r for r in requirements}


def test_the_gpu_extra_names_the_pins_of_requirements_gpu_txt():
    extra = pins(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"])
    stack = pins((ROOT / "requirements" / "gpu.txt").read_text().splitlines())
    assert extra and all(str(stack[name].specifier) == str(r.specifier) for name, r in extra.items()), extra


def test_the_gpu_pins_resolve_together(tmp_path):
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as e:
        pytest.skip(f"the package index is not reachable ({e}): pip cannot resolve the GPU stack here")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
         str(report), "-r", str(ROOT / "requirements" / "gpu.txt")],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {i["metadata"]["name"].lower(): Version(i["metadata"]["version"])
              for i in json.loads(report.read_text())["install"]}
    for name, requirement in pins((ROOT / "requirements" / "gpu.txt").read_text().splitlines()).items():
        assert chosen[name] in requirement.specifier, (name, chosen[name])
    assert chosen["torch"] == Version("2.14.0") and chosen["vllm"] == Version("0.33.0")
    print("resolved: " + ", ".join(f"{n} {chosen[n]}" for n in ("torch", "vllm", "triton", "torchtitan", "fla-core")))
