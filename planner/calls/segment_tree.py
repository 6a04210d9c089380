"""Segment trees: the fork structure of a rollout forest, one vertex per maximal fork-free token path (HARTS §3.3).

Legend: G segments. Segment g covers positions [start[g], end[g]) of every path through it. A root starts at 0; a
child starts where its parent ends (start[child] = end[parent] is the fork position p). Several roots = several
independent trees. A CompactBatch gives one directly (`SegmentTree.from_batch`); the segment-tree JSON of
`python -m planner calls` gives one from token counts (`segment_tree_from_json`).

External roots (prefix carry): the rows of one part of a larger tree may hang below rows executed
elsewhere. A root with `external[g] = c >= 0` continues the path c outside the tree: it starts at its fork position
p > 0, and its parent is that path's row at position p - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from planner.index_arrays import offsets

__all__ = ["SegmentTree", "segment_tree_from_json"]


def _int_array(name: str, value) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D array, got shape {tuple(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"`{name}` must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


@dataclass(eq=False)
class SegmentTree:
    """A rooted forest of segments, validated on construction.

    Args:
        parent: [G] int, parent segment or -1 for a root.
        start, end: [G] int, position interval [start, end) of each segment (end > start).
        names: optional [G] labels used in error messages and by the CLI (default: the segment index).
        external: optional [G] int, for a root that continues a path outside the tree the id (>= 0) of that path,
            else -1 (default: all -1, every root starts at 0).
    Derived:
        child_offsets [G+1], children [G - num_roots]: children of g are children[child_offsets[g]:child_offsets[g+1]],
            in increasing segment id (the fixed child order of Algorithm 1's recovery).
        order [G]: every parent before its children (breadth-first from the roots); reversed, a valid postorder.
        depth [G]: number of parent-child edges above the segment (state-handoff depth, HARTS §5.4).
    """

    parent: np.ndarray
    start: np.ndarray
    end: np.ndarray
    names: Sequence[Hashable] | None = None
    external: np.ndarray | None = None
    child_offsets: np.ndarray = field(init=False)
    children: np.ndarray = field(init=False)
    order: np.ndarray = field(init=False)
    depth: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.parent = _int_array("parent", self.parent)
        self.start = _int_array("start", self.start)
        self.end = _int_array("end", self.end)
        G = self.parent.size
        if G == 0:
            raise ValueError("a segment tree needs at least one segment, got none")
        if self.start.size != G or self.end.size != G:
            raise ValueError(
                f"`parent`, `start`, `end` must have one entry per segment, got {G}, {self.start.size}, {self.end.size}"
            )
        if self.names is not None and len(self.names) != G:
            raise ValueError(f"`names` must have one entry per segment ({G}), got {len(self.names)}")
        bad = np.flatnonzero((self.parent < -1) | (self.parent >= G))
        if bad.size:
            g = int(bad[0])
            raise ValueError(
                f"segment {self.name(g)}: parent index {self.parent[g]} is not a segment (use -1 for a root)"
            )
        bad = np.flatnonzero(self.end <= self.start)
        if bad.size:
            g = int(bad[0])
            raise ValueError(
                f"segment {self.name(g)}: needs at least one token, got [start, end) = [{self.start[g]}, {self.end[g]})"
            )
        roots = self.parent < 0
        if self.external is None:
            self.external = np.full(G, -1, dtype=np.int64)
        self.external = _int_array("external", self.external)
        if self.external.size != G:
            raise ValueError(f"`external` must have one entry per segment ({G}), got {self.external.size}")
        bad = np.flatnonzero((self.external >= 0) & (~roots | (self.start == 0)))
        if bad.size:
            g = int(bad[0])
            raise ValueError(
                f"segment {self.name(g)}: only a root that starts after position 0 can continue an external path"
            )
        bad = np.flatnonzero(roots & (self.external < 0) & (self.start != 0))
        if bad.size:
            g = int(bad[0])
            raise ValueError(f"root segment {self.name(g)} must start at position 0, got {self.start[g]}")
        self.child_offsets, self.children, self.order, self.depth = _topology(self.parent, self.name)
        kids = ~roots
        bad = np.flatnonzero(kids & (self.start != self.end[np.maximum(self.parent, 0)]))
        if bad.size:
            g = int(bad[0])
            p = int(self.parent[g])
            raise ValueError(
                f"segment {self.name(g)} must start where its parent {self.name(p)} ends ({self.end[p]}), "
                f"got {self.start[g]}"
            )

    @classmethod
    def from_lengths(cls, parent, lengths, names: Sequence[Hashable] | None = None) -> SegmentTree:
        """A tree from parent links and token counts; positions follow (root at 0, child after its parent)."""
        parent = _int_array("parent", parent)
        lengths = _int_array("lengths", lengths)
        if lengths.size != parent.size:
            raise ValueError(f"`lengths` must have one entry per segment ({parent.size}), got {lengths.size}")
        name = (lambda g: repr(names[g])) if names is not None else str
        bad = np.flatnonzero(lengths < 1)
        if bad.size:
            g = int(bad[0])
            raise ValueError(f"segment {name(g)}: tokens must be >= 1, got {lengths[g]}")
        bad = np.flatnonzero((parent < -1) | (parent >= parent.size))
        if bad.size:
            g = int(bad[0])
            raise ValueError(f"segment {name(g)}: parent index {parent[g]} is not a segment (use -1 for a root)")
        _, _, order, _ = _topology(parent, name)
        start = np.zeros(parent.size, dtype=np.int64)
        end = lengths.copy()
        par = parent.tolist()
        st, en = start.tolist(), end.tolist()
        for g in order.tolist():
            if par[g] >= 0:
                st[g] = en[par[g]]
                en[g] += st[g]
        return cls(parent, np.asarray(st, dtype=np.int64), np.asarray(en, dtype=np.int64), names)

    @classmethod
    def from_batch(cls, batch) -> SegmentTree:
        """The segment tree of a planner.pack.CompactBatch (segment ids = the batch's segment ids)."""
        return cls(batch.seg_parent, batch.seg_start, batch.seg_end)

    @property
    def num_segments(self) -> int:
        return int(self.parent.size)

    @property
    def roots(self) -> np.ndarray:
        return np.flatnonzero(self.parent < 0)

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start

    def name(self, g: int) -> str:
        return repr(self.names[g]) if self.names is not None else str(g)

    def row_offsets(self) -> np.ndarray:
        """[G+1] rows of segment g at [row_offsets[g], row_offsets[g+1]) in a layout with segments in id order."""
        return offsets(self.lengths)


def _topology(parent: np.ndarray, name) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Children CSR, breadth-first order from the roots and depth; raises if a parent link closes a cycle."""
    G = parent.size
    is_child = parent >= 0
    children = np.flatnonzero(is_child)[np.argsort(parent[is_child], kind="stable")]
    child_offsets = offsets(np.bincount(parent[is_child], minlength=G))
    kids, offs = children.tolist(), child_offsets.tolist()
    order = np.flatnonzero(~is_child).tolist()
    depth = [0] * G
    i = 0
    while i < len(order):
        v = order[i]
        d = depth[v] + 1
        for u in kids[offs[v] : offs[v + 1]]:
            depth[u] = d
            order.append(u)
        i += 1
    if len(order) < G:
        reached = np.zeros(G, dtype=bool)
        reached[order] = True
        stuck = np.flatnonzero(~reached)
        shown = ", ".join(name(int(g)) for g in stuck[:5]) + (", ..." if stuck.size > 5 else "")
        raise ValueError(f"segments {shown} are not reachable from a root: their parent links form a cycle")
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return child_offsets, as_array(children), as_array(order), as_array(depth)


_NODE_KEYS = ("id", "parent", "tokens")


def segment_tree_from_json(obj) -> SegmentTree:
    """Parse a segment-tree JSON object: {"nodes": [{"id": "R", "parent": null, "tokens": 3}, ...]}.

    One tree: exactly one node has parent null. Ids are strings or integers, unique; a parent's tokens precede its
    children's. The returned tree's `names` are the ids, segments in the order of the file.
    """
    if not isinstance(obj, dict) or set(obj) != {"nodes"}:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f'a segment-tree JSON must be an object with exactly one key "nodes", got {keys}')
    nodes = obj["nodes"]
    if not isinstance(nodes, list) or not nodes:
        raise ValueError('"nodes" must be a non-empty list of {"id", "parent", "tokens"} objects')
    ids: list = []
    index: dict = {}
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or set(node) != set(_NODE_KEYS):
            got = sorted(node) if isinstance(node, dict) else type(node).__name__
            raise ValueError(f'nodes[{i}] must have exactly the keys "id", "parent", "tokens", got {got}')
        nid = node["id"]
        if isinstance(nid, bool) or not isinstance(nid, (str, int)):
            raise ValueError(f"nodes[{i}]: id must be a string or an integer, got {nid!r}")
        if nid in index:
            raise ValueError(f"nodes[{i}]: duplicate id {nid!r} (also nodes[{index[nid]}])")
        tokens = node["tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"node {nid!r}: tokens must be an integer >= 1, got {tokens!r}")
        index[nid] = i
        ids.append(nid)
    parent = np.full(len(nodes), -1, dtype=np.int64)
    for i, node in enumerate(nodes):
        p = node["parent"]
        if p is None:
            continue
        if isinstance(p, bool) or not isinstance(p, (str, int)) or p not in index:
            raise ValueError(f"node {ids[i]!r}: unknown parent {p!r} (no node has this id)")
        parent[i] = index[p]
    roots = np.flatnonzero(parent < 0)
    if roots.size == 0:
        raise ValueError("no root: every node has a parent, so the links form a cycle (give the root parent null)")
    if roots.size > 1:
        raise ValueError(
            f"two roots {ids[roots[0]]!r} and {ids[roots[1]]!r}: a segment-tree JSON holds one tree "
            "(give every node but the root a parent)"
        )
    return SegmentTree.from_lengths(parent, [n["tokens"] for n in nodes], names=ids)
