"""Rollout trees that stress tree execution of chunkwise linear attention (shared by the tree tests and bench)."""

from __future__ import annotations

import numpy as np

from planner.trajectory import Trajectory


def nested_fork_trajectories(rng: np.random.Generator, chunk: int, vocab: int, depth: int = 5, tail: int | None = None,
                             trees: int = 2) -> list[Trajectory]:
    """Per tree: a chain of `depth` nested forks (handoff depth `depth`) whose fork positions sit at B-1, B, B+1 and
    mid-chunk offsets of the chunk grid, plus siblings at the same forks, an identical trajectory, a prefix of
    another, a single-token branch and a masked prompt. A second tree shares nothing but may share a first token."""
    tail = tail or 2 * chunk
    offsets = [-1, 0, 1, chunk // 2, 3]
    out = []
    for tree in range(trees):
        prompt = int(rng.integers(3, chunk))
        main = rng.integers(1, vocab, size=prompt + tail + depth * chunk)
        paths = [main]
        fork = prompt
        prev = main
        for level in range(depth):
            boundary = (fork // chunk + 1) * chunk
            fork = max(fork + 1, boundary + offsets[level % len(offsets)])
            child = np.concatenate([prev[:fork], rng.integers(1, vocab, size=tail)])
            paths.append(child)
            sibling = np.concatenate([prev[:fork], rng.integers(1, vocab, size=int(rng.integers(1, chunk)))])
            paths.append(sibling)
            prev = child
        paths.append(paths[1].copy())  # identical trajectory
        paths.append(paths[2][: len(paths[2]) - 1])  # a prefix of another
        paths.append(np.concatenate([main[:prompt + 5], rng.integers(1, vocab, size=1)]))  # single-token branch
        for p in paths:
            mask = np.ones(p.size, dtype=bool)
            mask[:prompt] = False
            out.append(Trajectory(tokens=p, loss_mask=mask, advantage=rng.normal(size=p.size), tree=f"t{tree}"))
    return out
