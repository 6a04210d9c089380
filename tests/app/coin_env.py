"""A two-turn environment whose reward a random policy earns half the time, so RL tests get nonzero advantages
without any training: each turn earns 1 when its first sampled token has an even id. Its tasks are digits, drawn
or read from records {"coin": int}."""

from __future__ import annotations

from rollout.envs import Environment, Reset, Step
from rollout.envs.records import required
from rollout.tokenizer import CHAT


class CoinEnv(Environment):
    name = "coin"

    def __init__(self, *, turns: int = 2) -> None:
        self.turns = turns

    def sample_tasks(self, count, rng):
        return [rng.randint(0, 9) for _ in range(count)]

    def task_from_record(self, record):
        return required(record, "coin", int)

    def reset(self, task):
        return Reset(prompt=f"{CHAT.bos}{CHAT.user}{task}{CHAT.end}{CHAT.assistant}", state=0)

    def step(self, state, action):
        reward = float(bool(action.token_ids) and action.token_ids[0] % 2 == 0)
        done = state + 1 >= self.turns
        observation = "" if done else f"{CHAT.tool}ok{CHAT.end}{CHAT.assistant}"
        return Step(observation=observation, reward=reward, done=done, state=state + 1)

    def solutions(self, task):
        return [[f"{2 * k}{CHAT.end}" for k in range(self.turns)]]


class OutOfVocabularyEnv(CoinEnv):
    """Answers the first turn with a token id outside every test vocabulary."""

    name = "out-of-vocabulary"

    def step(self, state, action):
        step = super().step(state, action)
        return Step(observation=[3, 500], reward=step.reward, done=step.done, state=step.state)
