"""Kernel settings (`models.ops.settings.KernelSettings`) travel from the model to every module that dispatches:
their defaults are the kernels a model ran before any choice, a model built with the row-wise references runs no
fused kernel anywhere (forward, backward, log-probabilities), `use_kernels` changes one model and not another, and
importing the model packages sets no environment variable."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import models.ops.rmsnorm.fused as rms_norm_fused
from models.decoder import HybridForCausalLM
from models.norms import RMSNorm
from models.ops import dispatch
from models.ops.settings import KernelSettings
from models.ops.tuned_configs import TUNED_CONFIGS
from models.presets import preset

ROOT = Path(__file__).resolve().parents[3]


def test_the_defaults_are_the_kernels_of_a_model_no_one_configured():
    assert KernelSettings() == KernelSettings(fused_rowwise=True, attention="flash", kernel_cache=None,
                                              tuned_configs=TUNED_CONFIGS)
    with pytest.raises(ValueError, match="`attention` must be one of flash, fa4, got 'auto'"):
        KernelSettings(attention="auto")


def _holders(model):
    return [m for m in model.modules() if isinstance(getattr(m, "kernels", None), KernelSettings)]


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_a_model_hands_its_settings_to_every_module_that_dispatches(name):
    torch.manual_seed(0)
    kernels = KernelSettings(fused_rowwise=False, attention="fa4")
    model = HybridForCausalLM(preset(name), kernels)
    other = HybridForCausalLM(preset(name))
    kinds = {type(m).__name__ for m in _holders(model)}
    assert {"HybridForCausalLM", "RMSNorm", "Experts"} <= kinds and len(kinds) >= 5, kinds
    assert all(m.kernels is kernels for m in _holders(model))
    assert all(m.kernels == KernelSettings() for m in _holders(other)), "another model keeps its own"
    assert all(m.kernels == kernels for m in _holders(copy.deepcopy(model)))
    model.use_kernels(KernelSettings())
    assert all(m.kernels == KernelSettings() for m in _holders(model))


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_the_row_wise_references_run_everywhere_when_the_settings_say_so(name, monkeypatch):
    """With every tensor taken for one the kernels run (`dispatch.use_fla`, which only the row-wise choice reads
    here), a model whose settings turn the fused row-wise ops off runs its forward, log-probabilities and backward
    on the references; a norm left on the defaults would take the (refused) kernel."""
    monkeypatch.setattr(dispatch, "use_fla", lambda t: True)
    monkeypatch.setattr(rms_norm_fused, "fused_rms_norm", lambda *a: pytest.fail("a fused kernel ran"))
    with pytest.raises(pytest.fail.Exception):
        RMSNorm(8, 1e-6, False)(torch.ones(2, 8))
    torch.manual_seed(0)
    model = HybridForCausalLM(preset(name), KernelSettings(fused_rowwise=False))
    ids = torch.randint(0, model.config.vocab_size, (40,))
    out = model.hidden_states(ids, cu_seqlens=torch.tensor([0, 25, 40]))
    rows = torch.arange(40) - 1
    logprobs = model.compact_logprobs(out.hidden, SimpleNamespace(logit_row=rows, target=ids), entropy=True)
    (logprobs[0].sum() + logprobs[1].sum()).backward()
    assert all(p.grad is not None for p in model.model.layers[0].parameters())


def test_importing_the_model_packages_sets_no_environment_variable():
    code = ("import json, os; before = dict(os.environ); import models, models.ops.kernel_environment, "
            "models.tree.layout, models.ops.kda.tree_calls; "
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {}
