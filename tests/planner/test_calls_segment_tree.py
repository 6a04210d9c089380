"""SegmentTree (planner/calls/segment_tree.py): validation and derived structure."""

import numpy as np
import pytest

from planner.calls.segment_tree import SegmentTree
from planner.pack import pack
from planner.trajectory import Trajectory


def test_from_batch_matches_the_trie():
    base = list(range(20))
    batch = pack([Trajectory(base), Trajectory(base[:5] + [99]), Trajectory(base[:12] + [98, 97]), Trajectory([7, 7])])
    tree = SegmentTree.from_batch(batch)  # 0 = [0, 5), 1 = [5, 12), 2 = [12, 20), 3 = [12, 14), 4 = [5, 6), 5 = [0, 2)
    assert tree.depth.tolist() == [0, 1, 2, 2, 1, 0] and tree.roots.tolist() == [0, 5]
    rank = np.empty(tree.num_segments, dtype=np.int64)
    rank[tree.order] = np.arange(tree.num_segments)
    kids = tree.parent >= 0
    assert (rank[tree.parent[kids]] < rank[kids]).all()  # parents first
    assert tree.children[tree.child_offsets[0] : tree.child_offsets[1]].tolist() == [1, 4]


def test_from_lengths_places_children_after_parents():
    tree = SegmentTree.from_lengths([2, 2, -1], [4, 1, 3], names=["a", "b", "r"])
    assert tree.start.tolist() == [3, 3, 0] and tree.end.tolist() == [7, 4, 3]


@pytest.mark.parametrize(
    "parent, start, end, error, message",
    [
        ([-1, 0], [0, 4], [5, 6], ValueError, "must start where its parent 0 ends \\(5\\), got 4"),
        ([-1, -1], [0, 2], [5, 6], ValueError, "root segment 1 must start at position 0"),
        ([-1, 0], [0, 5], [5, 5], ValueError, "segment 1: needs at least one token"),
        ([-1, 3], [0, 5], [5, 6], ValueError, "parent index 3 is not a segment"),
        ([-1, 2, 1], [0, 5, 5], [5, 6, 6], ValueError, "segments 1, 2 are not reachable from a root"),
        ([-1, 0], [0, 5], [5.0, 6.5], TypeError, "`end` must hold integers"),
        ([-1, 0], [0], [5, 6], ValueError, "one entry per segment"),
        ([], [], [], ValueError, "at least one segment"),
    ],
)
def test_invalid_trees(parent, start, end, error, message):
    with pytest.raises(error, match=message):
        SegmentTree(parent, start, end)
