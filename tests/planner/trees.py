"""Hypothesis strategies for branching rollout trees (shared by the planner and model tests)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from planner.trajectory import Trajectory

EOS = 0


@st.composite
def rollout_batches(draw, max_trajectories=8, max_len=24, vocab=5, max_trees=3):
    """Trajectories from several trees, with forks anywhere, duplicates, prefixes, single-token branches and EOS.

    Each tree starts from a random prompt; every further trajectory copies the prefix of an earlier trajectory of its
    tree up to a random fork point and appends random tokens (a small vocabulary also makes unrelated paths merge).
    Prompts are loss-masked; advantages and behaviour log-probs are random per token.
    """
    n_trees = draw(st.integers(1, max_trees))
    n = draw(st.integers(1, max_trajectories))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    trees: list[list[np.ndarray]] = [[] for _ in range(n_trees)]
    prompt_len = [int(rng.integers(1, 5)) for _ in range(n_trees)]
    out = []
    for _ in range(n):
        tree = int(rng.integers(n_trees))
        kind = rng.random()
        paths = trees[tree]
        if not paths:
            tokens = rng.integers(0, vocab, size=int(rng.integers(1, max_len + 1)))
        elif kind < 0.15:  # identical trajectory
            tokens = paths[int(rng.integers(len(paths)))].copy()
        elif kind < 0.3:  # a prefix of an earlier one
            src = paths[int(rng.integers(len(paths)))]
            tokens = src[: int(rng.integers(1, src.size + 1))].copy()
        else:  # fork from an earlier one, possibly a single-token branch, possibly ending in EOS
            src = paths[int(rng.integers(len(paths)))]
            fork = int(rng.integers(0, src.size + 1))
            tail = rng.integers(0, vocab, size=int(rng.integers(1, max_len + 1)))
            tokens = np.concatenate([src[:fork], tail])[:max_len]
            if rng.random() < 0.3:
                tokens = np.concatenate([tokens, [EOS]])
        paths.append(tokens)
        mask = np.ones(tokens.size, dtype=bool)
        mask[: prompt_len[tree]] = False
        out.append(
            Trajectory(
                tokens=tokens,
                loss_mask=mask,
                advantage=rng.normal(size=tokens.size),
                logprobs=-rng.random(tokens.size),
                weight=float(rng.uniform(0.5, 2.0)),
                tree=f"tree{tree}",
            )
        )
    return out
