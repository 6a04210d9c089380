"""The vLLM engine in its own process (rollout.vllm_process): the same results as the in-process engine, bit for bit,
before and after a weight update; the child's failures come back as the parent's exceptions; close() ends it.

Both engines start from the same checkpoint with the same engine seed and serve the same request sequence, so vLLM's
global sampling generator draws the same numbers: any difference is the process boundary's (ids or log-probs
altered in transit, weights lost or mis-named in the safetensors hand-over). The parent has torchrun's variables set,
as on rank 0 of a job (the multi-rank job itself, with its process group, is tests/app/test_distributed.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from rollout import EngineError  # noqa: E402
from rollout.engine import GenerationRequest  # noqa: E402
from rollout.tokenizer import build_char_tokenizer  # noqa: E402
from tests.rollout.tiny_checkpoint import save_checkpoint, tiny_qwen3_next  # noqa: E402

TOKENIZER = build_char_tokenizer()
PROMPTS = [TOKENIZER(text, add_special_tokens=False)["input_ids"]
           for text in ("<|bos|><|user|>12+7*3<|end|><|assistant|>", "<|bos|><|user|>9-4<|end|><|assistant|>")]
TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29533", "TORCHELASTIC_RUN_ID": "test"}


def requests():
    return [GenerationRequest(prompt_token_ids=p, n=3, max_new_tokens=12, temperature=1.0, top_p=1.0,
                              stop_token_ids=(TOKENIZER.eos_token_id,)) for p in PROMPTS]


def serve(engine, new_weights: dict) -> list:
    """Results of a batch, a weight update, and another batch."""
    before = engine.generate(requests())
    engine.update_weights(new_weights.items())
    return before + engine.generate(requests())


def test_process_engine_equals_in_process_engine(tmp_path, monkeypatch):
    from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig
    from rollout.vllm_process import VLLMProcessEngine

    config = VLLMEngineConfig(model=save_checkpoint(tiny_qwen3_next(seed=0), tmp_path / "old"), max_model_len=256,
                              kv_cache_memory_bytes=64 * 2**20, enforce_eager=True, seed=5)
    new_weights = load_file(save_checkpoint(tiny_qwen3_next(seed=1), tmp_path / "new") + "/model.safetensors")

    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    child = VLLMProcessEngine(config)
    for name in TORCHRUN:
        monkeypatch.delenv(name)
    try:
        got = serve(child, new_weights)
        assert child.weight_version == 1
        print(f"vLLM child process startup: {child.startup_seconds:.1f} s")

        with pytest.raises(ValueError, match="per-request seeds"):
            child.generate([GenerationRequest(prompt_token_ids=PROMPTS[0], n=1, max_new_tokens=2, temperature=1.0,
                                              top_p=1.0, stop_token_ids=(), seed=1)])
        with pytest.raises(EngineError, match="weight update 2 failed"):
            child.update_weights([("model.layers.0.no_such.weight", new_weights["lm_head.weight"])])
        assert child.vocab_size == len(TOKENIZER) and child.max_model_len == 256
    finally:
        child.close()
    assert not child._process.is_alive() and child._process.exitcode == 0
    with pytest.raises(EngineError, match="not running"):
        child.generate(requests())

    want = serve(VLLMEngine(config), new_weights)
    assert [r.completions for r in got] == [r.completions for r in want]
    assert [r.num_cached_tokens for r in got] == [r.num_cached_tokens for r in want]
    # The update changed the policy: the same requests sample differently afterwards.
    assert [r.completions for r in got[:2]] != [r.completions for r in got[2:]]
