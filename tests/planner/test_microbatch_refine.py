"""planner.microbatch.refine / .balance / .greedy: every step keeps a valid grouping with exact work accounting."""

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from bench.workloads import swe_like_step
from planner.lcp_index import LcpIndex
from planner.microbatch.balance import balance_atoms
from planner.microbatch.greedy import POLICIES, greedy_grouping, processing_orders, trie_greedy
from planner.microbatch.refine import (
    Grouping,
    _best_move,
    _best_swap,
    align_k,
    eliminate_small,
    refine_boundaries,
    sparse_repair,
)
from planner.microbatch.search import exact_dp, natural_partition
from planner.pack import pack
from tests.planner.trees import rollout_batches


def check_grouping(g, trajectories, capacity):
    """Nonempty microbatches 0..K-1 within capacity, recounted by an independent trie."""
    index = g.index
    assert (g.owner >= 0).all() and set(g.owner.tolist()) == set(range(g.k))
    for m, ranks in enumerate(g.groups()):
        work = pack([trajectories[i] for i in index.order[ranks]]).num_compact
        assert g.work[m] == work <= capacity


def setting(trajectories, slack):
    index = LcpIndex.from_trajectories(trajectories)
    return index, int(index.lengths.max()) + int(slack * index.total_work)


@settings(max_examples=80, deadline=None)
@given(rollout_batches(max_trajectories=12, max_len=16), st.floats(0, 0.7), st.integers(1, 3))
def test_refinements_keep_guarantees_and_never_add_work(trajectories, slack, dp):
    index, capacity = setting(trajectories, slack)
    starts = natural_partition(index, capacity)
    refined = refine_boundaries(index, capacity, starts, window=3, sweeps=2)
    assert len(refined) == len(starts) and (np.diff(refined) > 0).all()
    g = Grouping.from_starts(index, refined)
    check_grouping(g, trajectories, capacity)
    assert g.total <= Grouping.from_starts(index, starts).total
    repaired = sparse_repair(g, capacity, window=3, iterations=4)
    check_grouping(repaired, trajectories, capacity)
    assert repaired.k == g.k and repaired.total <= g.total
    balanced = balance_atoms(repaired, capacity)
    check_grouping(balanced, trajectories, capacity)
    assert balanced.k == g.k and balanced.total <= repaired.total
    assert np.square(balanced.work).sum() <= np.square(repaired.work).sum()
    reduced = eliminate_small(g, capacity, dp)
    for e in reduced:
        check_grouping(e, trajectories, capacity)
        assert e.k % dp == 0
    if g.k % dp == 0:  # elimination adds no work; a final align_k result is kept only if it has less than that
        assert reduced[0].total == g.total and all(e.total <= g.total for e in reduced)


@settings(max_examples=60, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=16), st.floats(0, 0.7), st.integers(1, 3))
def test_greedy_plans(trajectories, slack, dp):
    index, capacity = setting(trajectories, slack)
    orders = processing_orders(index)
    assert all(sorted(o.tolist()) == list(range(index.size)) for o in orders.values())
    for order in orders.values():
        for policy in POLICIES:
            check_grouping(greedy_grouping(index, capacity, order, policy), trajectories, capacity)
    found = trie_greedy(index, capacity, dp)
    if found is not None:
        check_grouping(found[1], trajectories, capacity)
        assert found[1].k % dp == 0


@settings(max_examples=60, deadline=None)
@given(rollout_batches(max_trajectories=10, max_len=16), st.integers(2, 4))
def test_align_k_splits_cheapest(trajectories, dp):
    index, capacity = setting(trajectories, 1.0)
    assume(index.size >= dp)
    g = Grouping.from_starts(index, np.array([0]))  # everything in one microbatch
    aligned = align_k(g, dp)
    assert aligned.k == dp
    check_grouping(aligned, trajectories, capacity)
    # Cuts of one lexicographic range keep every other cut's price: the dp - 1 cheapest adjacent LCPs are paid.
    assert aligned.total == g.total + np.sort(index.lcp[1:])[: dp - 1].sum()


def test_exact_dp_seeds_a_valid_grouping_on_a_generated_step():
    trajectories = swe_like_step(3, scale=0.05, token_scale=0.1)
    index = LcpIndex.from_trajectories(trajectories)
    capacity = 6554
    g = Grouping.from_starts(index, exact_dp(index, capacity, 4))
    check_grouping(g, trajectories, capacity)
    for e in eliminate_small(g, capacity, 4):
        check_grouping(e, trajectories, capacity)


@settings(max_examples=120, deadline=None)
@given(rollout_batches(max_trajectories=12, max_len=16), st.floats(0, 0.7), st.randoms(use_true_random=False))
def test_sparse_repair_deltas_are_exact(trajectories, slack, rnd):
    """From a grouping built in a random order, the best move's (or swap's) claimed gain is the trie-counted gain."""
    index, capacity = setting(trajectories, slack)
    g = greedy_grouping(index, capacity, np.array(rnd.sample(range(index.size), index.size)), "best_fit")

    def trie_total(owner):
        return sum(pack([trajectories[i] for i in index.order[owner == m]]).num_compact for m in range(g.k))

    move = _best_move(g, capacity, window=3)
    if move is not None:
        r, m, gain = move
        owner = g.owner.copy()
        owner[r] = m
        assert trie_total(owner) == g.total - gain and gain > 0
    else:
        swap = _best_swap(g, capacity, window=3)
        if swap is not None:
            x, y, works = swap
            owner = g.owner.copy()
            owner[x], owner[y] = owner[y], owner[x]
            assert trie_total(owner) == g.total - (g.work[g.owner[x]] + g.work[g.owner[y]] - works.sum())
            assert trie_total(owner) < g.total
    repaired = sparse_repair(g, capacity, window=3)
    check_grouping(repaired, trajectories, capacity)
    assert repaired.k == g.k
    assert repaired.total < g.total if move is not None else repaired.total <= g.total
