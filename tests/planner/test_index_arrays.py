"""planner.index_arrays: range offsets and inverse permutations."""

import numpy as np

from planner.index_arrays import inverse_permutation, offsets


def test_offsets_are_exclusive_prefix_sums():
    out = offsets(np.array([3, 0, 2], dtype=np.int32))
    assert out.tolist() == [0, 3, 3, 5] and out.dtype == np.int64
    assert offsets([]).tolist() == [0]


def test_inverse_permutation():
    perm = np.random.default_rng(0).permutation(11)
    inv = inverse_permutation(perm)
    assert (inv[perm] == np.arange(11)).all() and (perm[inv] == np.arange(11)).all() and inv.dtype == np.int64
    assert inverse_permutation(np.array([2, 0, 1])).tolist() == [1, 2, 0]
