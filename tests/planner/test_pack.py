import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.pack import pack
from planner.trajectory import Trajectory
from tests.planner.trees import rollout_batches


def brute_force_trie(trajectories):
    """Every distinct (prefix incl. token) is one node."""
    return {tuple(t.tokens[: i + 1].tolist()) for t in trajectories for i in range(len(t))}


def test_walkthrough_example():
    A, B, C, D, E, F, G = 10, 11, 12, 13, 14, 15, 16
    batch = pack([Trajectory([A, B, C, D]), Trajectory([A, B, C, E]), Trajectory([A, B, F, G])])
    assert batch.num_semantic == 12 and batch.num_compact == 7
    assert batch.tokens.tolist() == [A, B, C, D, E, F, G]
    assert batch.positions.tolist() == [0, 1, 2, 3, 3, 2, 3]
    assert batch.compression == pytest.approx(12 / 7)
    predicted = batch.logit_row >= 0
    assert predicted.sum() == 9
    assert sorted(set(batch.logit_row[predicted].tolist())) == [0, 1, 2, 5]  # 9 predictions from 4 logit rows
    assert batch.logit_row[predicted].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 5]
    assert batch.sem_tokens[predicted].tolist() == [B, C, D, B, C, E, B, F, G]


@settings(max_examples=200, deadline=None)
@given(rollout_batches(), st.booleans())
def test_packing_invariants(trajectories, share):
    """The trie's invariants; unshared (the flat expansion), every trajectory is a path of its own in input order."""
    batch = pack(trajectories, share=share)
    C, S = batch.num_compact, batch.num_semantic
    if share:
        assert C == len(brute_force_trie(trajectories))
    else:
        assert C == S and (batch.sem_to_compact == np.arange(S)).all() and (batch.multiplicity == 1).all()
    assert batch.multiplicity.sum() == S and (batch.multiplicity >= 1).all()
    # Each semantic position maps to a row whose ancestor chain spells its prefix, at the right depth.
    for i, t in enumerate(trajectories):
        rows = batch.sem_to_compact[batch.traj_offsets[i] : batch.traj_offsets[i + 1]]
        assert batch.tokens[rows].tolist() == t.tokens.tolist()
        assert batch.positions[rows].tolist() == list(range(len(t)))
        assert batch.parent[rows[0]] == -1
        assert (batch.parent[rows[1:]] == rows[:-1]).all()
    # Preorder: parents precede children; subtree ranges are exactly the descendants.
    assert (batch.parent < np.arange(C)).all()
    for r in range(C):
        inside = np.arange(r, batch.subtree_end[r])
        anc = inside.copy()
        for _ in range(batch.max_depth):
            anc = np.where(anc > r, batch.parent[anc], anc)
        assert (anc == r).all()
        if batch.subtree_end[r] < C:
            c = batch.subtree_end[r]
            while c > r:
                c = batch.parent[c]
            assert c != r
    # Segments: contiguous fork-free paths; children of a segment start at its end position.
    for g in range(batch.num_segments):
        lo, hi = batch.seg_offsets[g], batch.seg_offsets[g + 1]
        assert (batch.segment[lo:hi] == g).all()
        assert batch.positions[lo:hi].tolist() == list(range(batch.seg_start[g], batch.seg_end[g]))
        assert (batch.parent[lo + 1 : hi] == np.arange(lo, hi - 1)).all()
        kids = np.flatnonzero(batch.seg_parent == g)
        assert len(kids) != 1
        assert (batch.seg_start[kids] == batch.seg_end[g]).all()
        n_children = np.count_nonzero(batch.parent == hi - 1)
        assert n_children == len(kids) or (n_children <= 1 and len(kids) == 0)
    # Metadata in original order.
    flat = np.concatenate([t.tokens for t in trajectories])
    assert (batch.sem_tokens == flat).all()
    assert (batch.advantage == np.concatenate([t.advantage for t in trajectories])).all()
    assert not batch.loss_mask[batch.traj_offsets[:-1]].any()


def test_different_trees_with_identical_prefixes_merge():
    a = Trajectory([1, 2, 3], tree="a")
    b = Trajectory([1, 2, 4], tree="b")
    batch = pack([a, b])
    assert batch.num_compact == 4
    assert batch.multiplicity.tolist() == [2, 2, 1, 1]


def test_empty_input_is_an_error():
    with pytest.raises(ValueError, match="at least one trajectory"):
        pack([])


def test_bad_tokens_are_errors():
    with pytest.raises(ValueError, match="tokens"):
        Trajectory([])
    with pytest.raises(ValueError, match=r"\[0, "):
        Trajectory([1, -2])
    with pytest.raises(ValueError, match="one entry per token"):
        Trajectory([1, 2, 3], loss_mask=[1, 0])
