"""Demonstration trees replay an environment's solutions: shared prefixes, loss masks, reward 1."""

from __future__ import annotations

import random

import pytest

from rollout import demonstration_tree
from rollout.envs import CalculatorEnv, CalculatorTask
from rollout.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()


def test_two_operation_task_gives_two_branches():
    env = CalculatorEnv(num_operations=2)
    task = env.sample_tasks(1, random.Random(3))[0]
    tree = demonstration_tree(env, task, TOKENIZER, tree_id="demo0")
    whole, stepwise = tree.trajectories()
    assert len(tree.root.children) == 2 and whole.reward == stepwise.reward == 1.0
    assert whole.logprobs is None
    text = TOKENIZER.decode(whole.tokens.tolist())
    assert text == (
        f"<|bos|><|user|>{task.question}<|end|><|assistant|><|call|>{task.question}<|end|>"
        f"<|tool|>{task.answer}<|end|><|assistant|><|answer|>{task.answer}<|end|>"
    )
    masked = TOKENIZER.decode(whole.tokens[whole.loss_mask].tolist())
    assert masked == f"<|call|>{task.question}<|end|><|answer|>{task.answer}<|end|>"
    assert stepwise.extra["turns"] == 3 and TOKENIZER.decode(stepwise.tokens.tolist()).count("<|call|>") == 2


def test_one_operation_task_is_one_path():
    env = CalculatorEnv(num_operations=1)
    tree = demonstration_tree(env, env.sample_tasks(1, random.Random(0))[0], TOKENIZER, tree_id=0)
    assert len(tree.trajectories()) == 1 and len(tree.nodes) == 4


def test_wrong_solution_is_rejected():
    class Wrong(CalculatorEnv):
        def solutions(self, task):
            return [["<|answer|>0<|end|>"]]

    with pytest.raises(ValueError, match="solution 0 of tree 5 .* earns reward 0.0"):
        demonstration_tree(Wrong(), CalculatorTask("2+2", 4, ("2+2",)), TOKENIZER, tree_id=5)
