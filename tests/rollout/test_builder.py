"""build_trees with a scripted engine: branching policies, path ends, rewards and error context."""

from __future__ import annotations

import pytest

from rollout import RolloutConfig, build_trees
from rollout.engine import Completion, Engine, GenerationResult
from rollout.envs import CalculatorEnv, CalculatorTask
from rollout.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
TASK = CalculatorTask(question="3*4", answer=12, steps=("3*4",))


class Scripted(Engine):
    """Completion i of a request: at the first turn i=0 is malformed and i>0 a correct call; after a tool error a
    correct call; after a tool result the correct answer."""

    def __init__(self, max_model_len: int = 256) -> None:
        self._max_model_len = max_model_len
        self.requests = []

    vocab_size = property(lambda self: len(TOKENIZER))
    max_model_len = property(lambda self: self._max_model_len)

    def generate(self, requests):
        self.requests.extend(requests)
        return [GenerationResult([self._complete(r, i) for i in range(r.n)], 0) for r in requests]

    def _complete(self, request, i):
        prompt = TOKENIZER.decode(list(request.prompt_token_ids))
        if prompt.endswith("<|user|>3*4<|end|><|assistant|>"):
            text = "oops<|end|>" if i == 0 else "<|call|>3*4<|end|>"
        elif "error" in prompt.rsplit("<|tool|>", 1)[-1]:
            text = "<|call|>3*4<|end|>"
        else:
            text = "<|answer|>12<|end|>"
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"][: request.max_new_tokens]
        return Completion(tuple(ids), tuple(-0.5 for _ in ids), "stop" if len(ids) == len(text) else "length")

    def reseed(self, seed):
        raise NotImplementedError

    def update_weights(self, named_tensors):
        raise NotImplementedError


def fan_outs(engine: Scripted) -> dict[str, list[int]]:
    """n of each request, keyed by what the prompt ends with."""
    out = {"start": [], "tool": [], "failure": []}
    for r in engine.requests:
        last = TOKENIZER.decode(list(r.prompt_token_ids)).rsplit("<|tool|>", 1)
        key = "start" if len(last) == 1 else ("failure" if "error" in last[1] else "tool")
        out[key].append(r.n)
    return out


@pytest.mark.parametrize(
    "branch_at, after_failure, after_tool", [("every_turn", 3, 3), ("tool_calls", 1, 3), ("retries", 3, 1)]
)
def test_branch_policies(branch_at, after_failure, after_tool):
    engine = Scripted()
    config = RolloutConfig(fan_out=3, branch_at=branch_at, max_turns=3)
    (tree,) = build_trees(engine, CalculatorEnv(), [TASK], config, TOKENIZER)
    # Turn 0: 3 children (1 malformed, 2 calls). Turn 1: the failure node retries with `after_failure` calls, the
    # 2 tool results get `after_tool` answers each. Turn 2: each retried call's result gets `after_tool` answers.
    assert fan_outs(engine) == {
        "start": [3], "failure": [after_failure], "tool": [after_tool] * (2 + after_failure)
    }
    leaves = tree.leaves()
    assert len(leaves) == (2 + after_failure) * after_tool
    assert all(leaf.end == "done" and leaf.reward == 1.0 for leaf in leaves)
    assert [t.reward for t in tree.trajectories()] == [1.0] * len(leaves)


def test_path_ends():
    config = RolloutConfig(fan_out=1, max_turns=1)
    (tree,) = build_trees(Scripted(), CalculatorEnv(), [TASK], config, TOKENIZER)
    (leaf,) = tree.leaves()
    assert leaf.end == "max_turns" and leaf.role == "assistant" and tree.trajectories()[0].reward == 0.0

    prompt_len = len(TOKENIZER(CalculatorEnv().reset(TASK).prompt, add_special_tokens=False)["input_ids"])
    engine = Scripted(max_model_len=prompt_len + 3)
    (tree,) = build_trees(engine, CalculatorEnv(), [TASK], RolloutConfig(fan_out=2, max_turns=3), TOKENIZER)
    assert [r.max_new_tokens for r in engine.requests] == [3]
    assert {leaf.end for leaf in tree.leaves()} == {"context_full"}


def test_environment_exception_names_tree_and_turn():
    class Broken(CalculatorEnv):
        def step(self, state, action):
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom") as info:
        build_trees(Scripted(), Broken(), [TASK], RolloutConfig(), TOKENIZER, tree_ids=["run3/tree5"])
    assert "environment 'calculator' step() for tree run3/tree5, turn 0" in info.value.__notes__[0]


def test_tree_ids_must_be_unique():
    with pytest.raises(ValueError, match="`tree_ids` must hold 2 unique ids"):
        build_trees(Scripted(), CalculatorEnv(), [TASK, TASK], RolloutConfig(), TOKENIZER, tree_ids=[1, 1])
