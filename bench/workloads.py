"""Seeded synthetic rollout-tree steps shaped like published agentic-RL workloads, for planner and packing benchmarks.

    swe_like_step(seed, *, scale=1.0, token_scale=1.0, vocab_size=157_184, max_path_tokens=65_536) -> list[Trajectory]
    tau2_like_step(seed, *, scale=1.0, token_scale=1.0, vocab_size=157_184, max_path_tokens=16_384) -> list[Trajectory]
    python -m bench.workloads {swe,tau2} --seed 0 --out TRAJ.jsonl [--scale 0.01] [--token-scale 0.01]

`scale` multiplies the number of trajectories of a step and `token_scale` every token length (segment lengths and
`max_path_tokens`); whole trees are generated until the path count is reached, so `swe_like_step(0, scale=0.01,
token_scale=0.01)` is one tree (20-120 paths, 3-30K tokens) shaped like the trees of a full step. Tokens are uniform
random ids in [0, vocab_size) (default: Ling-3-tiny's 157,184). The first tokens of siblings always differ, so two
paths share exactly the prefix the generator gave them, and the compact size of a step (unique trie tokens) is the
sum of its branch lengths. Same seed and arguments -> identical trajectories.

SWE-like steps (HARTS §5 Table 2 and Appendix A, Figures 6-8: Claude-Code-scaffold SWE-bench trees). One step holds
1,300-2,400 paths (uniform, times `scale`) and about 39-60M raw tokens (~26K per path). Every tree hangs from a tiny
root segment (the 3-token chat-template start, shared by all trees of the step) and has:
  * a main agent: a 2-token header and a ~400-token task prompt, then a chain of turns with heavy-tailed lengths
    (median 1.2K, up to 30K tokens) reaching 60-99% of `max_path_tokens`. Most turns leave a side leaf forking at the
    turn's first token (the request as first sent, whose thinking block later turns strip; most start with one
    marker token, so they sort consistently); some turns spawn a retry chain forking at an arbitrary offset inside
    the turn (forks are not aligned to turns or chunks), which grows its own side leaves and retries;
  * 0-2 sub-agent chains with their own prompts, and sometimes a probe subtree (a ~633-token prompt with a fan-out of
    1-16-token answers, like Figure 7's E) and a helper subtree (a ~256-token prompt fanning out into 100-1,500-token
    branches that may fork again, like F and I).
Calibration (seeds 0-3): the whole-step trie compresses 8.4-9.0x; the minimum-work contiguous partition at
T = 65,536 (planner.microbatch.search.exact_dp) compresses 5.1-5.9x, as HARTS's 5.6x after partitioning.
No path is longer than `max_path_tokens` (the microbatch capacity T = 65,536 of HARTS).

tau2-like steps (AReaL-DTA, tau2-bench: 9.43x compression over all sequences, 5.56x over leaves only). GRPO groups of
`group_size` rollouts answer one task: the group shares a 6-9K-token domain policy and tool prompt and the user's
opening message; each rollout is a short multi-turn dialogue (about 1K tokens). The context of its last LLM call is a
trajectory, and so, with a small probability, is each earlier call's context (a prefix of the last one): about 1.7
trajectories per rollout, which gives AReaL-DTA's two compression figures. Dialogues stay within 16,384 tokens.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np

from planner.index_arrays import offsets
from planner.jsonl import write_jsonl
from planner.trajectory import Trajectory

__all__ = ["swe_like_step", "tau2_like_step", "VOCAB_SIZE", "SweShape", "Tau2Shape", "main"]

#: Ling-3-tiny's vocabulary.
VOCAB_SIZE = 157_184


@dataclass(frozen=True, kw_only=True)
class SweShape:
    """Token lengths (before `token_scale`) and probabilities of the SWE-like tree model.

    Lognormal lengths are (median, sigma, min, max): lognormal(log(median), sigma) clipped to [min, max].
    """

    paths_per_step: tuple[int, int] = (1300, 2400)
    """Paths of one step, uniform in [lo, hi], times `scale`."""
    root_tokens: int = 3
    """The tiny root segment shared by every tree of the step (chat-template start)."""
    agent_header_tokens: int = 2
    agent_prompt_tokens: tuple[int, int] = (380, 420)
    """System + task prompt of the main agent, uniform in [lo, hi]."""
    chain_fraction: tuple[float, float] = (0.6, 0.99)
    """Depth reached by the main chain, as a fraction of max_path_tokens, uniform."""
    turn: tuple[float, float, int, int] = (1200.0, 1.0, 40, 30_000)
    """Lognormal length of one turn of a chain (response + tool output)."""
    side_probability: float = 0.8
    """A turn leaves a side leaf: the request as first sent (with its thinking block, stripped later), forking at the
    turn's first token."""
    side: tuple[float, float, int, int] = (800.0, 1.0, 1, 8000)
    """Lognormal length of a side leaf."""
    marker_probability: float = 0.7
    """A side leaf starts with the step's marker token (a thinking-block start), else with a random token."""
    retry_probability: float = 0.08
    """A turn spawns a retry: a new chain forking at an arbitrary offset inside the turn."""
    retry_fraction: tuple[float, float] = (0.1, 0.5)
    """A retry grows to this fraction (uniform) of the room left below max_path_tokens."""
    max_retry_depth: int = 2
    """Retries inside retries, at most this deep."""
    subagents: tuple[int, int] = (0, 2)
    """Sub-agent chains per tree (uniform count), hanging from the root with their own prompt."""
    subagent_prompt_tokens: tuple[int, int] = (600, 1500)
    subagent_fraction: tuple[float, float] = (0.2, 0.6)
    """Depth reached by a sub-agent chain, as a fraction of max_path_tokens, uniform."""
    probe_probability: float = 0.25
    probe_prompt_tokens: int = 633
    probe_fanout: tuple[int, int] = (2, 8)
    probe_answer_tokens: tuple[int, int] = (1, 16)
    helper_probability: float = 0.25
    helper_prompt_tokens: int = 256
    helper_fanout: tuple[int, int] = (2, 6)
    helper_branch_tokens: tuple[int, int] = (100, 1500)
    helper_refork_probability: float = 0.3

    def spines(self) -> tuple[tuple[int, ...], ...]:
        """Longest lengths of the segments each tree hangs below the root before a branch can grow: every path of
        the step must leave room for one more token after them."""
        return ((self.root_tokens, self.agent_header_tokens, self.agent_prompt_tokens[1]),
                (self.root_tokens, self.subagent_prompt_tokens[1]), (self.root_tokens, self.probe_prompt_tokens),
                (self.root_tokens, self.helper_prompt_tokens))


@dataclass(frozen=True, kw_only=True)
class Tau2Shape:
    """Token lengths (before `token_scale`) and counts of the tau2-like dialogue model."""

    trajectories_per_step: tuple[int, int] = (1500, 2500)
    """LLM calls (trajectories) of one step, uniform in [lo, hi], times `scale`."""
    root_tokens: int = 3
    group_size: int = 16
    """Rollouts per task (GRPO group)."""
    prompt_tokens: tuple[int, int] = (6000, 9000)
    """Domain policy + tool schema prompt of a task, uniform."""
    opening_tokens: tuple[int, int] = (30, 200)
    """The simulated user's first message, shared by the group."""
    turns: tuple[int, int] = (2, 8)
    """Agent turns (LLM calls) per rollout, uniform."""
    reply_tokens: tuple[int, int] = (20, 200)
    """Tokens generated by the agent per turn, uniform."""
    observation_tokens: tuple[int, int] = (20, 240)
    """Tool output or user message appended after each reply, uniform."""
    record_probability: float = 0.19
    """Each call but the last is also a trajectory of its own (a prefix of the final context) with this probability."""

    def spines(self) -> tuple[tuple[int, ...], ...]:
        """As SweShape.spines: the root, the task prompt and the opening message precede every dialogue."""
        return ((self.root_tokens, self.prompt_tokens[1], self.opening_tokens[1]),)


class _Forest:
    """Branches of one step. Branch b attaches after the first `offset[b]` tokens of branch `parent[b]` (-1: none)
    and owns `length[b]` tokens of its own; a path is the prefix up to the attachment point plus the branch's own
    tokens."""

    def __init__(self, rng: np.random.Generator, token_scale: float, max_path_tokens: int):
        self.rng = rng
        self.token_scale = token_scale
        self.max_path = max_path_tokens
        self.parent: list[int] = []
        self.offset: list[int] = []
        self.length: list[int] = []
        self.depth: list[int] = []  # path length at the end of the branch
        self.leaf: list[bool] = []
        self.tree: list[int] = []
        self.first: dict[int, int] = {}  # branch -> requested first token id
        self.marker = 0

    def scaled(self, tokens: float) -> int:
        return _scaled(tokens, self.token_scale)

    def add(self, parent: int, offset: int, length: int, tree: int, leaf: bool = True) -> int:
        """A branch of `length` own tokens (clipped to the room left below max_path, at least 1)."""
        base = self.depth[parent] - self.length[parent] + offset if parent >= 0 else 0
        length = max(1, min(length, self.max_path - base))
        return self._append(parent, offset, length, tree, leaf)

    def add_prefix(self, parent: int, end: int, tree: int) -> None:
        """A path that ends after the first `end` tokens of branch `parent` (a prefix of the parent's paths)."""
        self._append(parent, end, 0, tree, True)

    def _append(self, parent: int, offset: int, length: int, tree: int, leaf: bool) -> int:
        base = self.depth[parent] - self.length[parent] + offset if parent >= 0 else 0
        assert base + length <= self.max_path and (length >= 1 or base >= 1)
        self.parent.append(parent)
        self.offset.append(offset)
        self.length.append(length)
        self.depth.append(base + length)
        self.leaf.append(leaf)
        self.tree.append(tree)
        return len(self.parent) - 1

    def room(self, parent: int, offset: int) -> int:
        return self.max_path - (self.depth[parent] - self.length[parent] + offset)

    def trajectories(self, vocab_size: int, tree_prefix: str) -> list[Trajectory]:
        """Draw the tokens (one random array sliced per branch) and concatenate every leaf's path."""
        n = len(self.parent)
        length = np.asarray(self.length, dtype=np.int64)
        starts = offsets(length)
        pool = self.rng.integers(0, vocab_size, size=int(starts[-1]), dtype=np.int64)
        # Siblings (same parent and offset) and the parent's own continuation must start with distinct tokens.
        taken: dict[tuple[int, int], set[int]] = {}
        for b in range(n):
            p, o = self.parent[b], self.offset[b]
            if p < 0 or self.length[b] == 0:
                continue
            used = taken.setdefault((p, o), set())
            if not used and o < self.length[p]:
                used.add(int(pool[starts[p] + o]))
            tok = self.first.get(b, int(pool[starts[b]]))
            while tok in used:
                tok = int(self.rng.integers(0, vocab_size))
            pool[starts[b]] = tok
            used.add(tok)
        out = []
        for b in range(n):
            if not self.leaf[b]:
                continue
            pieces = [pool[starts[b] : starts[b + 1]]]
            p, o = self.parent[b], self.offset[b]
            while p >= 0:
                pieces.append(pool[starts[p] : starts[p] + o])
                p, o = self.parent[p], self.offset[p]
            out.append(Trajectory(tokens=np.concatenate(pieces[::-1]), tree=f"{tree_prefix}{self.tree[b]}"))
        return out


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> float:
    return float(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def _chain(f: _Forest, shape: SweShape, parent: int, offset: int, budget: int, tree: int, retry_depth: int) -> int:
    """Grow a chain of turns attached at (parent, offset) to about `budget` tokens, with side leaves and retries.
    Returns the number of paths (leaves) added."""
    rng = f.rng
    turns = []
    total = 0
    while total < budget:
        turn = f.scaled(_lognormal(rng, *shape.turn))
        turn = min(turn, budget - total)
        turns.append(turn)
        total += turn
    chain = f.add(parent, offset, total, tree)
    paths = 1
    start = 0
    for turn in turns:
        if rng.random() < shape.side_probability:
            side = f.add(chain, start, f.scaled(_lognormal(rng, *shape.side)), tree)
            if rng.random() < shape.marker_probability:
                f.first[side] = f.marker
            paths += 1
        if retry_depth < shape.max_retry_depth and rng.random() < shape.retry_probability:
            at = start + int(rng.integers(0, turn))  # an arbitrary offset inside the turn
            budget = max(1, int(f.room(chain, at) * rng.uniform(*shape.retry_fraction)))
            paths += _chain(f, shape, chain, at, budget, tree, retry_depth + 1)
        start += turn
    return paths


def _swe_tree(f: _Forest, shape: SweShape, root: int, tree: int) -> int:
    rng = f.rng
    r = f.length[root]
    header = f.add(root, r, f.scaled(shape.agent_header_tokens), tree, leaf=False)
    prompt = f.add(header, f.length[header], f.scaled(rng.integers(*shape.agent_prompt_tokens, endpoint=True)), tree,
                   leaf=False)
    paths = _agent(f, shape, prompt, shape.chain_fraction, tree)
    for _ in range(int(rng.integers(*shape.subagents, endpoint=True))):
        sub = f.add(root, r, f.scaled(rng.integers(*shape.subagent_prompt_tokens, endpoint=True)), tree, leaf=False)
        paths += _agent(f, shape, sub, shape.subagent_fraction, tree)
    if rng.random() < shape.probe_probability:
        probe = f.add(root, r, f.scaled(shape.probe_prompt_tokens), tree, leaf=False)
        for _ in range(int(rng.integers(*shape.probe_fanout, endpoint=True))):
            f.add(probe, f.length[probe], f.scaled(rng.integers(*shape.probe_answer_tokens, endpoint=True)), tree)
            paths += 1
    if rng.random() < shape.helper_probability:
        helper = f.add(root, r, f.scaled(shape.helper_prompt_tokens), tree, leaf=False)
        for _ in range(int(rng.integers(*shape.helper_fanout, endpoint=True))):
            branch = f.add(helper, f.length[helper], f.scaled(rng.integers(*shape.helper_branch_tokens, endpoint=True)),
                           tree)
            paths += 1
            if rng.random() < shape.helper_refork_probability:
                at = int(rng.integers(0, f.length[branch]))
                f.add(branch, at, f.scaled(rng.integers(*shape.helper_branch_tokens, endpoint=True)), tree)
                paths += 1
    return paths


def _agent(f: _Forest, shape: SweShape, prompt: int, fraction: tuple[float, float], tree: int) -> int:
    """A chain below `prompt` reaching a depth of `fraction` (uniform) of max_path_tokens."""
    room = f.room(prompt, f.length[prompt])
    budget = int(f.max_path * f.rng.uniform(*fraction)) - (f.max_path - room)
    return _chain(f, shape, prompt, f.length[prompt], min(max(1, budget), room), tree, 0)


def _scaled(tokens: float, token_scale: float) -> int:
    return max(1, int(round(tokens * token_scale)))


def _check(scale: float, token_scale: float, vocab_size: int, max_path_tokens: int, shape) -> None:
    for name, value in (("scale", scale), ("token_scale", token_scale)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be > 0 and finite, got {value}")
    if not 2 <= vocab_size <= 2**32:
        raise ValueError(f"`vocab_size` must lie in [2, 2**32], got {vocab_size}")
    if max_path_tokens < 1:
        raise ValueError(f"`max_path_tokens` must be >= 1, got {max_path_tokens}")
    longest = _scaled(max_path_tokens, token_scale)
    need = max(sum(_scaled(n, token_scale) for n in spine) for spine in shape.spines()) + 1
    if longest < need:
        raise ValueError(
            f"`token_scale` = {token_scale:g} leaves paths of at most {longest} tokens (max_path_tokens "
            f"{max_path_tokens} x token_scale), fewer than the tree model's prompts ({need - 1} tokens) and one more "
            "token: raise `token_scale` (or `max_path_tokens`)"
        )


def swe_like_step(
    seed: int,
    *,
    scale: float = 1.0,
    token_scale: float = 1.0,
    vocab_size: int = VOCAB_SIZE,
    max_path_tokens: int = 65_536,
    shape: SweShape = SweShape(),
) -> list[Trajectory]:
    """One training step of SWE-agent-like rollout trees (see the module docstring for the tree model).

    Args:
        seed: any int; the same arguments give identical trajectories.
        scale: fraction of the 1,300-2,400 paths of a full step (at least one tree is generated).
        token_scale: multiplies every token length, including `max_path_tokens` (each length stays >= 1).
        vocab_size: token ids are uniform in [0, vocab_size).
        max_path_tokens: no trajectory is longer than max(1, round(max_path_tokens * token_scale)).
        shape: the tree model's lengths and probabilities.
    Returns:
        root-to-leaf trajectories, tree by tree (tree ids "swe{seed}-{k}"), default metadata.
    """
    _check(scale, token_scale, vocab_size, max_path_tokens, shape)
    rng = np.random.default_rng([seed, 0x5E])
    f = _Forest(rng, token_scale, _scaled(max_path_tokens, token_scale))
    target = max(1, int(round(rng.integers(*shape.paths_per_step, endpoint=True) * scale)))
    root = f.add(-1, 0, f.scaled(shape.root_tokens), -1, leaf=False)
    f.marker = int(rng.integers(0, vocab_size))
    paths = tree = 0
    while paths < target:
        paths += _swe_tree(f, shape, root, tree)
        tree += 1
    return f.trajectories(vocab_size, f"swe{seed}-")


def tau2_like_step(
    seed: int,
    *,
    scale: float = 1.0,
    token_scale: float = 1.0,
    vocab_size: int = VOCAB_SIZE,
    max_path_tokens: int = 16_384,
    shape: Tau2Shape = Tau2Shape(),
) -> list[Trajectory]:
    """One training step of tau2-bench-like GRPO groups of multi-turn dialogues (see the module docstring).

    Arguments as in `swe_like_step`; tree ids are "tau{seed}-{task}", one tree per task (group).
    """
    _check(scale, token_scale, vocab_size, max_path_tokens, shape)
    rng = np.random.default_rng([seed, 0x7A])
    f = _Forest(rng, token_scale, _scaled(max_path_tokens, token_scale))
    target = max(1, int(round(rng.integers(*shape.trajectories_per_step, endpoint=True) * scale)))
    root = f.add(-1, 0, f.scaled(shape.root_tokens), -1, leaf=False)
    calls = task = 0
    while calls < target:
        prompt = f.add(root, f.length[root], f.scaled(rng.integers(*shape.prompt_tokens, endpoint=True)), task,
                       leaf=False)
        opening = f.add(prompt, f.length[prompt], f.scaled(rng.integers(*shape.opening_tokens, endpoint=True)), task,
                        leaf=False)
        for _ in range(shape.group_size):
            calls += _dialogue(f, shape, opening, task)
        task += 1
    return f.trajectories(vocab_size, f"tau{seed}-")


def _dialogue(f: _Forest, shape: Tau2Shape, opening: int, task: int) -> int:
    """One rollout: a chain of (reply, observation) turns. Its last call's context is a trajectory; so is each earlier
    call's context (a prefix of it) with probability `record_probability`."""
    rng = f.rng
    lengths = []
    for _ in range(int(rng.integers(*shape.turns, endpoint=True))):
        lengths.append(f.scaled(rng.integers(*shape.reply_tokens, endpoint=True)))
        lengths.append(f.scaled(rng.integers(*shape.observation_tokens, endpoint=True)))
    ends = np.cumsum(lengths[:-1])[::2]  # the context of call k ends after its reply
    room = f.room(opening, f.length[opening])
    ends = ends[ends <= room]
    if ends.size == 0:
        ends = np.array([min(lengths[0], room)])
    chain = f.add(opening, f.length[opening], int(ends[-1]), task)
    recorded = [int(end) for end in ends[:-1] if rng.random() < shape.record_probability]
    for end in recorded:
        f.add_prefix(chain, end, task)
    return 1 + len(recorded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("swe", "tau2"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="TRAJ.jsonl to write")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the paths of a full step")
    parser.add_argument("--token-scale", type=float, default=1.0, help="multiplies every token length")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    make = swe_like_step if args.kind == "swe" else tau2_like_step
    try:
        trajectories = make(args.seed, scale=args.scale, token_scale=args.token_scale, vocab_size=args.vocab_size)
    except ValueError as e:  # the argument checks of _check
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(trajectories, args.out)
    tokens = sum(len(t) for t in trajectories)
    print(f"wrote {len(trajectories)} trajectories, {tokens} tokens to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
