"""planner.index_arrays: range offsets, inverse permutations, floor(log2)."""

import numpy as np

from planner.index_arrays import floor_log2, inverse_permutation, offsets


def test_offsets_are_exclusive_prefix_sums():
    out = offsets(np.array([3, 0, 2], dtype=np.int32))
    assert out.tolist() == [0, 3, 3, 5] and out.dtype == np.int64
    assert offsets([]).tolist() == [0]


def test_inverse_permutation():
    perm = np.random.default_rng(0).permutation(11)
    inv = inverse_permutation(perm)
    assert (inv[perm] == np.arange(11)).all() and (perm[inv] == np.arange(11)).all() and inv.dtype == np.int64
    assert inverse_permutation(np.array([2, 0, 1])).tolist() == [1, 2, 0]


def test_floor_log2():
    x = np.array([1, 2, 3, 4, 7, 8, 2**40 - 1, 2**40, 2**52 + 1], dtype=np.int64)
    assert floor_log2(x).tolist() == [0, 1, 1, 2, 2, 3, 39, 40, 52]
