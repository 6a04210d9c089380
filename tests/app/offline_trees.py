"""The bundled offline example, configs/data/calculator_trees.jsonl: recorded calculator trees as another RL stack
would write them, and how it was generated (`python -m tests.app.offline_trees OUT.jsonl`).

Each tree is one task of the demo's calculator (one operation on operands 0..3, seeded): the prompt, the tool call,
the tool's answer, then FAN_OUT final answers (the right one and wrong ones), each rewarded by the environment
(1 or 0). Every path records its tokens (the character tokenizer of configs/offline.toml's model), the loss mask
(assistant tokens), the reward, GRPO advantages over its tree (app.advantages, tree grouping), and behaviour
log-probs: those of the policy that configs/offline.toml starts from (tiny-qwen3-next, width 128, train.seed 0),
rounded to 4 decimals, so its first step's importance weights are 1 and |dlogp| is the rounding.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import numpy as np
import torch

from app.advantages import assign_advantages
from app.config import ModelSection
from app.policy import build_policy
from models.microbatch import prepare_microbatch
from models.step import Step
from parallel.plain_runner import PlainRunner
from planner.jsonl import write_jsonl
from planner.trajectory import Trajectory
from rollout import demonstration_tree
from rollout.envs import CalculatorEnv
from rollout.envs.base import Action
from rollout.tokenizer import CHAT

TREES = 24
FAN_OUT = 4
MODEL = ModelSection(preset="tiny-qwen3-next", vocab_size=128, hidden_size=128)


def calculator_trees() -> list[Trajectory]:
    """The example's trajectories, tree by tree."""
    env = CalculatorEnv(num_operations=1, max_operand=3)
    policy, tokenizer = build_policy(MODEL, seed=0)
    trajectories = []
    for i, task in enumerate(env.sample_tasks(TREES, random.Random(0))):
        tree = demonstration_tree(env, task, tokenizer, f"calc-{i}")
        (answer,) = [n for n in tree.nodes if n.role == "assistant" and n.turn == 1]
        wrong = [a for a in range(-9, 37) if a != task.answer]
        for value in random.Random(i).sample(wrong, FAN_OUT - 1):
            ids = tokenizer(f"{CHAT.answer}{value}{CHAT.end}", add_special_tokens=False)["input_ids"]
            text = tokenizer.decode(ids, skip_special_tokens=False)
            step = env.step(task, Action(text=text, token_ids=tuple(ids), finished=True))
            node = tree.add(answer.parent, "assistant", ids, turn=1)
            node.reward, node.end = step.reward, "done"
        trajectories += tree.trajectories()
    assign_advantages(trajectories, "tree", scale_by_std=True)
    with torch.no_grad():
        step = Step.self_contained([prepare_microbatch(trajectories, policy.config, torch.device("cpu"))])
        (logprobs,) = PlainRunner(policy).score(step)
    offsets = np.cumsum([0] + [len(t) for t in trajectories])
    out = []
    for t, lo, hi in zip(trajectories, offsets[:-1], offsets[1:]):
        behaviour = np.where(t.loss_mask, np.round(logprobs[lo:hi].numpy(), 4), 0.0)
        out.append(dataclasses.replace(t, advantage=np.round(t.advantage, 6), logprobs=behaviour, extra={}))
    return out


if __name__ == "__main__":
    write_jsonl(calculator_trees(), Path(sys.argv[1]))
