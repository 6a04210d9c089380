"""The torch engine: behaviour log-probs of the tempered distribution, seeded reproducibility, weight updates in
Hugging Face checkpoint format, stop and length endings."""

from __future__ import annotations

import pytest
import torch

from app.config import ModelSection
from app.policy import build_policy
from app.torch_engine import TorchEngine
from models.hf_io import checkpoint_tensors
from rollout.engine import GenerationRequest

MODEL = ModelSection(vocab_size=128, hidden_size=64)


def request(prompt, *, n=3, seed=11, temperature=0.8, stop=(), max_new_tokens=6, top_p=1.0):
    return GenerationRequest(prompt_token_ids=prompt, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_p=top_p, stop_token_ids=tuple(stop), seed=seed)


def test_logprobs_are_those_of_the_tempered_model():
    model, tokenizer = build_policy(MODEL, seed=0)
    prompt = tokenizer("<|bos|><|user|>2+3<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    (result,) = TorchEngine(model, 64).generate([request(prompt, temperature=0.7)])
    assert len(result.completions) == 3
    for c in result.completions:
        ids = torch.tensor(prompt + list(c.token_ids))
        with torch.no_grad():
            logits = model.flat_forward(ids).logits[len(prompt) - 1 : -1].double() / 0.7
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), expected, rtol=0, atol=1e-5)


def test_seeded_requests_repeat_and_children_differ():
    model, _ = build_policy(MODEL, seed=0)
    prompt = [1, 5, 9, 12]
    first = TorchEngine(model, 64).generate([request(prompt), request(prompt, seed=99)])
    again = TorchEngine(model, 64, seed=123).generate([request(prompt), request(prompt, seed=99)])
    assert first == again
    ids = [c.token_ids for c in first[0].completions]
    assert len(set(ids)) > 1, "children of one request use seeds seed + i"


def test_update_weights_takes_checkpoint_format_tensors():
    model, _ = build_policy(MODEL, seed=0)
    other, _ = build_policy(MODEL, seed=1)
    engine = TorchEngine(model, 64)
    engine.update_weights(checkpoint_tensors(other))
    assert engine.weight_version == 1
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), other.state_dict().values()))
    with pytest.raises(Exception, match="no tensor 'model.embed_tokens.weight'"):
        engine.update_weights([(n, t) for n, t in checkpoint_tensors(other) if "embed" not in n])


def test_stop_and_length_endings_and_top_p():
    model, _ = build_policy(MODEL, seed=0)
    engine = TorchEngine(model, 64)
    (result,) = engine.generate([request([1, 2, 3], n=16, max_new_tokens=4, stop=range(0, 128, 4))])
    for c in result.completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] % 4 == 0 and all(t % 4 for t in c.token_ids[:-1])
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 4
    assert {c.finish_reason for c in result.completions} == {"stop", "length"}
    with pytest.raises(NotImplementedError, match="top_p must be 1"):
        engine.generate([request([1, 2], top_p=0.9)])
