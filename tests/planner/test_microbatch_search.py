"""planner.lcp_index and planner.microbatch.search against brute force and an independent trie (planner.pack)."""

import itertools
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.lcp_index import LcpIndex, lexicographic_lcp
from planner.microbatch.search import (
    best_split,
    evolve,
    exact_dp,
    k_candidates,
    natural_partition,
    sample_ks,
    window_starts,
)
from planner.pack import pack
from planner.trajectory import Trajectory
from tests.planner.trees import rollout_batches


def lcp(a, b):
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def ranges(starts, n):
    return list(zip(starts.tolist(), (np.append(starts[1:], n) - 1).tolist()))


@pytest.mark.parametrize("byteorder", [">", "="])
def test_lexicographic_lcp_sorts_by_the_bytes_of_the_chosen_order(byteorder):
    """">" sorts by token id, "=" by the native-endian bytes; a proper prefix first, equal sequences stay in order."""
    seqs = [[256, 1], [1], [256], [1, 256, 7], [1], [2**32 - 1, 0], [1, 256]]
    endian = "big" if byteorder == ">" else sys.byteorder
    key = lambda s: [int.from_bytes(t.to_bytes(4, endian), "big") for t in s]  # noqa: E731
    want = sorted(range(len(seqs)), key=lambda i: key(seqs[i]))
    order, adjacent = lexicographic_lcp([np.array(s, dtype=np.int64) for s in seqs], byteorder=byteorder)
    assert order.tolist() == want and order.dtype == np.int64
    assert adjacent.tolist() == [0] + [lcp(np.array(seqs[a]), np.array(seqs[b])) for a, b in zip(want, want[1:])]
    if byteorder == ">":
        assert want == [1, 4, 6, 3, 2, 0, 5]


@settings(max_examples=80, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=20), st.randoms(use_true_random=False))
def test_lcp_index_matches_trie(trajectories, rnd):
    index = LcpIndex.from_trajectories(trajectories)
    n = index.size
    assert sorted(index.order.tolist()) == list(range(n)) and (index.rank[index.order] == np.arange(n)).all()
    keys = [tuple(trajectories[i].tokens.tolist()) for i in index.order]
    # A depth-first order of the trie: every set of trajectories sharing a prefix is contiguous.
    for depth in range(1, 21):
        prefixes = [k[:depth] for k in keys if len(k) >= depth]
        seen = [p for i, p in enumerate(prefixes) if i == 0 or p != prefixes[i - 1]]
        assert len(seen) == len(set(seen))
    assert index.total_work == pack(trajectories).num_compact
    for _ in range(6):
        a, b = sorted(rnd.sample(range(n), 2)) if n > 1 else (0, 0)
        x, y = trajectories[index.order[a]].tokens, trajectories[index.order[b]].tokens
        assert index.pair_lcp(a, b) == lcp(x, y)
        assert index.interval_work(a, b) == pack([trajectories[i] for i in index.order[a : b + 1]]).num_compact
        subset = rnd.sample(range(n), rnd.randint(1, n))
        assert index.set_work(index.rank[subset]) == pack([trajectories[i] for i in subset]).num_compact  # eq. 5
    stop_l, floor_l, stop_r, floor_r = index.floor_windows()
    for r in range(n):
        for j in range(n):
            if j < stop_l[r]:
                assert index.pair_lcp(j, r) == floor_l[r]
            if j >= stop_r[r]:
                assert index.pair_lcp(r, j) == floor_r[r]


def brute_force_best(index, capacity, dp):
    """Least work over every contiguous partition into a multiple of dp capacity-feasible ranges, or None."""
    n, best = index.size, None
    for k in range(dp, n + 1, dp):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            works = [index.interval_work(a, b - 1) for a, b in zip(bounds, bounds[1:])]
            if max(works) <= capacity and (best is None or sum(works) < best):
                best = sum(works)
    return best


@settings(max_examples=200, deadline=None)
@given(rollout_batches(max_trajectories=9, max_len=12), st.integers(1, 4), st.floats(0, 1))
def test_exact_dp_equals_brute_force(trajectories, dp, slack):
    index = LcpIndex.from_trajectories(trajectories)
    capacity = int(index.lengths.max()) + int(slack * index.total_work)
    starts = exact_dp(index, capacity, dp)
    best = brute_force_best(index, capacity, dp)
    if best is None:
        assert starts is None
        return
    works = [index.interval_work(a, b) for a, b in ranges(starts, index.size)]
    assert starts[0] == 0 and (np.diff(starts) > 0).all() and len(starts) % dp == 0
    assert max(works) <= capacity
    assert sum(works) == best == index.total_work + index.lcp[starts[1:]].sum()  # eq. 6


@settings(max_examples=100, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=16), st.integers(1, 3), st.floats(0, 1))
def test_natural_partition_and_evolution(trajectories, dp, slack):
    index = LcpIndex.from_trajectories(trajectories)
    n = index.size
    capacity = int(index.lengths.max()) + int(slack * index.total_work)
    lo = window_starts(index, capacity)
    for e in range(n):
        assert index.interval_work(lo[e], e) <= capacity
        assert lo[e] == 0 or index.interval_work(lo[e] - 1, e) > capacity
    p0 = natural_partition(index, capacity)
    assert all(index.interval_work(a, b) <= capacity for a, b in ranges(p0, n))
    ks = k_candidates(index, capacity, dp, p0.size)
    assert ks[0] % dp == 0 and ks[0] * capacity * 1.0 >= index.total_work and all(k % dp == 0 for k in ks)
    for k, starts in evolve(index, capacity, p0, ks).items():
        assert len(starts) == k and starts[0] == 0 and (np.diff(starts) > 0).all()
        assert all(index.interval_work(a, b) <= capacity for a, b in ranges(starts, n))


def test_best_split_prefers_lowest_valley_then_balance():
    trajectories = [Trajectory(t) for t in ([1, 1, 5], [1, 1, 6], [2, 7], [3, 3, 3, 8], [3, 3, 3, 9])]
    index = LcpIndex.from_trajectories(trajectories)
    assert index.lcp.tolist() == [0, 2, 0, 0, 3]
    # Valleys at t = 2 (sides 4 and 7) and t = 3 (sides 6 and 5): the smaller larger side wins.
    assert best_split(index, 0, 4) == (0, 6, 1, 3)


def test_sample_ks():
    ks = list(range(4, 400, 4))
    sampled = sample_ks(ks, 32)
    assert len(sampled) <= 33 and sampled[0] == 4 and sampled[-1] == 396 and set(sampled) <= set(ks)
    assert sampled[:16] == ks[:16]
    assert sample_ks(ks[:10], 32) == ks[:10]
