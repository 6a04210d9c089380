"""Calculator environment: exact arithmetic, robustness to garbage turns, rewards."""

from __future__ import annotations

import random

import numpy as np
import pytest

from rollout.envs import Action, CalculatorEnv, RecordError
from rollout.envs.calculator import CalculatorError, evaluate
from rollout.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()


def action(text: str) -> Action:
    ids = tuple(TOKENIZER(text, add_special_tokens=False)["input_ids"])
    return Action(text=text, token_ids=ids, finished=text.endswith("<|end|>"))


@pytest.mark.parametrize("num_operations", [1, 2, 4])
def test_tasks_evaluate_like_python(num_operations):
    env = CalculatorEnv(num_operations=num_operations, max_operand=30)
    for task in env.sample_tasks(50, random.Random(num_operations)):
        # Python's eval as an independent reference on strings we generated ourselves.
        assert evaluate(task.question) == eval(task.question) == task.answer
        assert len(task.steps) == num_operations
        assert all(evaluate(step) == eval(step) for step in task.steps)


@pytest.mark.parametrize("text", ["1+", "(2*3", "2**3", "abc", "", "9" * 49, "99999999*99999999"])
def test_evaluate_rejects(text):
    with pytest.raises(CalculatorError):
        evaluate(text)


def test_episode():
    env = CalculatorEnv()
    task = env.sample_tasks(1, random.Random(0))[0]
    reset = env.reset(task)
    assert reset.prompt == f"<|bos|><|user|>{task.question}<|end|><|assistant|>"
    step = env.step(reset.state, action(f"<|call|>{task.question}<|end|>"))
    assert step.observation == f"<|tool|>{task.answer}<|end|><|assistant|>" and not step.done and not step.tool_failed
    assert env.step(step.state, action(f"<|answer|>{task.answer}<|end|>")).reward == 1.0
    assert env.step(step.state, action(f"<|answer|>{task.answer + 1}<|end|>")).reward == 0.0
    failed = env.step(step.state, action("<|call|>1+<|end|>"))
    assert failed.observation == "<|tool|>error: bad expression<|end|><|assistant|>" and failed.tool_failed


def test_garbage_turns_never_crash():
    env = CalculatorEnv(num_operations=2)
    task = env.sample_tasks(1, random.Random(1))[0]
    state = env.reset(task).state
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, len(TOKENIZER), size=rng.integers(1, 33)).tolist()
        if rng.random() < 0.5:
            ids[-1] = TOKENIZER.eos_token_id
        text = TOKENIZER.decode(ids, skip_special_tokens=False)
        step = env.step(state, Action(text=text, token_ids=tuple(ids), finished=ids[-1] == TOKENIZER.eos_token_id))
        assert step.reward == 0.0 and step.state is state
        observation = TOKENIZER(step.observation, add_special_tokens=False)["input_ids"]
        assert len(observation) <= 40
        if step.done:
            assert text.startswith("<|answer|>") and text.endswith("<|end|>")
        else:
            assert step.tool_failed and step.observation.startswith("<|tool|>error: ")


def test_tasks_from_records():
    env = CalculatorEnv()
    task = env.task_from_record({"question": "(3+4)*5", "steps": ["3+4", "7*5"], "id": "extra keys are ignored"})
    assert (task.question, task.answer, task.steps) == ("(3+4)*5", 35, ("3+4", "7*5"))
    assert env.solutions(task)[1] == ["<|call|>3+4<|end|>", "<|call|>7*5<|end|>", "<|answer|>35<|end|>"]
    single = env.task_from_record({"question": "2*3", "answer": 6})
    assert env.solutions(single) == [["<|call|>2*3<|end|>", "<|answer|>6<|end|>"]]


@pytest.mark.parametrize("record, field, message", [
    ({}, "question", "missing"),
    ({"question": "2+"}, "question", "not a calculator expression"),
    ({"question": "2+2", "answer": 5}, "answer", "is not the value"),
    ({"question": "2+2", "answer": "4"}, "answer", "must be an integer"),
    ({"question": "2+2", "steps": "2+2"}, "steps", "must be a list"),
    ({"question": "2+2", "steps": ["2+"]}, "steps", "not a calculator expression"),
], ids=["missing", "expression", "wrong-answer", "answer-type", "steps-type", "bad-step"])
def test_bad_records_name_the_field(record, field, message):
    with pytest.raises(RecordError, match=message) as info:
        CalculatorEnv().task_from_record(record)
    assert info.value.field == field
