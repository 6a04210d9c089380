"""The vLLM engine on a CUDA GPU, each case in its own process (`tests.rollout.vllm_cuda_case` says what it checks).

Shapes vLLM serves: Qwen3-Next's linear layers need more value heads than key heads (with equal counts vLLM's GDN
decode gets non-contiguous `a`/`b`: "must be contiguous in the last dim"); Kimi-Linear's MLA needs a prefill backend
for query-key head dim nope + rope, which vLLM 0.26 on Hopper lacks without flashinfer (FLASH_ATTN: "Head dimension
192 is not supported by MLA"; 96 finds no backend at all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
vllm = pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]
MLA_PREFILL_MISSING = pytest.mark.xfail(
    Version(vllm.__version__) < Version("0.27"), strict=True,
    reason="vLLM 0.26 on Hopper has no MLA prefill backend for Kimi-Linear's head dims without flashinfer")


@pytest.mark.parametrize(("name", "mode"), [
    ("tiny-qwen3-next", "eager"), ("tiny-qwen3-next", "graphs"),
    pytest.param("tiny-kimi-linear", "eager", marks=MLA_PREFILL_MISSING),
])
def test_engine_on_cuda(name, mode, tmp_path):
    run = subprocess.run([sys.executable, "-m", "tests.rollout.vllm_cuda_case", name, mode, str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout.strip().splitlines()[-1])
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["|dlogp| mean"] <= 0.05 and "zeroed head log-prob" in report
