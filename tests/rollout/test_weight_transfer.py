"""NamedTensorSource: vLLM's weight-source contract (metadata agrees with iteration, per-layer groups).

NCCLWeightSender itself needs CUDA and NCCL and is not tested here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from rollout.weight_transfer import NamedTensorSource  # noqa: E402


def test_named_tensor_source():
    calls = []
    tensors = {
        "model.embed_tokens.weight": torch.randn(5, 3),
        "model.layers.0.mlp.experts.1.up_proj.weight": torch.randn(2, 3),
        "model.layers.0.input_layernorm.weight": torch.randn(3, dtype=torch.bfloat16),
        "model.layers.1.input_layernorm.weight": torch.randn(3),
        "lm_head.weight": torch.randn(5, 3),
    }

    def named_tensors():
        calls.append(1)
        return iter(tensors.items())

    source = NamedTensorSource(named_tensors)
    meta = source.metadata()
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    assert source.metadata() is meta and len(calls) == 1
    groups = [names for names, _ in source.iter_groups()]
    assert groups == [["model.embed_tokens.weight"], list(tensors)[1:3], [list(tensors)[3]], ["lm_head.weight"]]
    assert [name for name, _ in source] == list(tensors) and len(calls) == 3
