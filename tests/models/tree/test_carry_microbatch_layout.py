"""Carry layouts (`models.tree.carry_microbatch_layout`, prepared by `models.carry_microbatch.prepare_carry_step`): the
parts of a step's trees execute every trie row once and score every position once, the links between microbatches fit
their exports, and bad parts or events are refused with one clear error. Exactness against trajectory-wise
training: tests/parallel/test_carry_runner.py (which cuts trees with the helpers here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.branching import nested_fork_trajectories
from models.carry_microbatch import prepare_carry_step
from models.microbatch import StepNormalizer, trained_counts
from planner.pack import pack
from tests.models.tree.test_execute import small_config


def step_trees(chunk: int, vocab: int):
    """Two nested-fork trees (forks at B-1, B, B+1 and mid-chunk offsets), grouped by tree."""
    rng = np.random.default_rng(3)
    trajectories = nested_fork_trajectories(rng, chunk, vocab, depth=3, trees=2)
    for t in trajectories:
        t.weight = float(rng.uniform(0.5, 1.5))
    trees: dict[str, list] = {}
    for t in trajectories:
        trees.setdefault(t.tree, []).append(t)
    return list(trees.values())


def cut_rows(batch, chunk: int, min_rows: int = 8) -> list[int]:
    """Part boundaries of one tree: first rows of side branches forking at positions B-1, 0, 1 (mod B), and rows at
    positions 1 and B-1 (mod B) inside its longest segment, keeping parts of at least `min_rows` rows."""
    starts = batch.seg_offsets[:-1]
    forks = starts[(batch.seg_parent >= 0) & np.isin(batch.seg_start % chunk, [chunk - 1, 0, 1])]
    longest = int(np.argmax(np.diff(batch.seg_offsets)))
    rows = np.arange(batch.seg_offsets[longest], batch.seg_offsets[longest + 1])
    inside = rows[np.isin(batch.positions[rows] % chunk, [1, chunk - 1])][1::2]
    cuts = []
    for r in sorted(set(forks.tolist()) | set(inside.tolist())):
        if r - (cuts[-1] if cuts else 0) >= min_rows and batch.num_compact - r >= min_rows:
            cuts.append(int(r))
    return cuts


def carry_parts(trees, chunk: int) -> list[list[tuple[int, int, int]]]:
    """Microbatch k holds part k of every tree that has one."""
    per_tree = []
    for t, trajectories in enumerate(trees):
        batch = pack(trajectories)
        bounds = [0, *cut_rows(batch, chunk), batch.num_compact]
        per_tree.append([(t, a, b) for a, b in zip(bounds[:-1], bounds[1:])])
    return [[p[k] for p in per_tree if k < len(p)] for k in range(max(map(len, per_tree)))]


def prepared(config, trees, parts=None, **kwargs):
    parts = carry_parts(trees, config.chunk_size) if parts is None else parts
    counts = trained_counts([t for ts in trees for t in ts])
    return prepare_carry_step(trees, parts, config, torch.device("cpu"), normalizer=StepNormalizer(*counts), **kwargs)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_parts_run_every_row_once_and_score_every_position_once(name):
    config = small_config(name)
    trees = step_trees(config.chunk_size, config.vocab_size)
    step = prepared(config, trees)
    batches = [pack(ts) for ts in trees]
    assert sum(mb.num_compact for mb in step) == sum(b.num_compact for b in batches)
    assert sum(float(mb.layout.row_weight.sum()) for mb in step) == sum(b.num_semantic for b in batches)
    assert sum(mb.loss.token_share for mb in step) == pytest.approx(1.0)
    for t, b in enumerate(batches):
        scored = np.concatenate([s for mb in step for p, s in zip(mb.parts, mb.scored) if p.tree == t])
        assert np.array_equal(np.sort(scored), np.arange(b.num_semantic))
    for m, mb in enumerate(step):
        assert mb.layout.attention.context_rows == sum(int(pack(trees[p.tree]).positions[p.start]) for p in mb.parts)
        for kind, runs in mb.links.imports.items():
            assert all(producer < m for producer, _ in runs)
            for producer, rows in runs:
                exported = step[producer].links.exports[kind]
                size = len(exported) if isinstance(exported, tuple) else (
                    exported.stop - exported.start if isinstance(exported, slice) else exported.numel())
                top = rows.stop if isinstance(rows, slice) else int(rows.max()) + 1
                assert top <= size


def test_bad_parts_and_events_are_refused():
    config = small_config("tiny-kimi-linear")
    trees = step_trees(config.chunk_size, config.vocab_size)[:1]
    rows = pack(trees[0]).num_compact
    with pytest.raises(ValueError, match="must cover its"):
        prepared(config, trees, [[(0, 0, 10)], [(0, 12, rows)]])
    with pytest.raises(ValueError, match="reads rows of another of its parts"):
        prepared(config, trees, [[(0, 0, 10), (0, 10, rows)]])
    with pytest.raises(ValueError, match="at least one part"):
        prepared(config, trees, [[(0, 0, rows)], []])
    with pytest.raises(ValueError, match="the step has 1 trees"):
        prepared(config, trees, [[(1, 0, rows)]])
    with pytest.raises(ValueError, match="one 'backward' per microbatch"):
        prepared(config, trees, [[(0, 0, 10)], [(0, 10, rows)]], events=[("forward", 0), ("forward", 1)])
