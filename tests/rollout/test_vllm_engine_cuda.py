"""The vLLM engine on a CUDA GPU, each case in its own process (`tests.rollout.vllm_cuda_case` says what it checks).

Shapes vLLM 0.26 serves on Hopper: Qwen3-Next's linear layers need more value heads than key heads (with equal counts
vLLM's GDN decode gets non-contiguous `a`/`b`: "must be contiguous in the last dim"); Kimi-Linear's MLA needs head dims
that vLLM's FLASH_ATTN prefill knows and a kv latent + rope dim of 320 or 576 for its decode, so the Kimi case runs
the `tiny-kimi-linear-48b-mla` preset (Kimi-Linear-48B's MLA dims), not `tiny-kimi-linear`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
vllm = pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "mode"), [
    ("tiny-qwen3-next", "eager"), ("tiny-qwen3-next", "graphs"),
    ("tiny-kimi-linear-48b-mla", "eager"), ("tiny-kimi-linear-48b-mla", "graphs"),
])
def test_engine_on_cuda(name, mode, tmp_path):
    run = subprocess.run([sys.executable, "-m", "tests.rollout.vllm_cuda_case", name, mode, str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout.strip().splitlines()[-1])
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert "zeroed head log-prob" in report
