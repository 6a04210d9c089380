"""Checkpoint folders: atomic writes (unfinished writes are invisible), replacement, pruning, RNG round trip; and the
tree picture drawn for TensorBoard."""

from __future__ import annotations

import random

import numpy as np
import torch

from app.checkpoint import Checkpointer, rng_state, set_rng_state
from app.environments import make_environment
from app.tree_picture import BOX_H, GAP_Y, render_tree
from rollout import build_char_tokenizer, demonstration_tree


def test_unfinished_writes_are_invisible_and_removed(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=2)
    checkpoints.save(1, {"x": torch.ones(2)})
    # A run killed while writing step 2 leaves only its temporary folder behind.
    (tmp_path / "step-00000002.tmp").mkdir()
    (tmp_path / "step-00000002.tmp" / "state.pt").write_bytes(b"truncated")
    assert checkpoints.steps() == [1] and checkpoints.latest() == tmp_path / "step-00000001"
    assert torch.equal(checkpoints.load()["x"], torch.ones(2))
    checkpoints.save(2, {"x": torch.zeros(2)})
    assert checkpoints.steps() == [1, 2] and torch.equal(checkpoints.load()["x"], torch.zeros(2))
    assert checkpoints.remove_all() == 2
    assert list(tmp_path.iterdir()) == []


def test_replace_and_prune(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        checkpoints.save(step, {"step": step})
    checkpoints.save(3, {"step": 33})
    assert checkpoints.steps() == [2, 3]
    assert checkpoints.load()["step"] == 33
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]


def test_rng_round_trip():
    state = rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(state)
    assert draws == (random.random(), np.random.rand(), torch.rand(1))


def test_tree_picture_has_one_row_per_path():
    tokenizer = build_char_tokenizer()
    env = make_environment("calculator", {"num_operations": 2})
    tree = demonstration_tree(env, env.sample_tasks(1, random.Random(0))[0], tokenizer, tree_id="demo")
    image = render_tree(tree, tokenizer)
    paths = len(tree.leaves())
    assert paths == 2
    assert image.height >= paths * (BOX_H + GAP_Y)
    pixels = np.asarray(image)
    # Both demonstrations are rewarded: their answer boxes carry the green outline.
    assert (pixels == (40, 150, 60)).all(-1).sum() > 100
