"""Balance microbatch work without adding compact work, by moving "atoms" between microbatches.

Legend: N trajectories at lexicographic ranks (planner/lcp_index.py), K microbatches, T capacity.
Let f be the prefix every trajectory shares (the minimum adjacent LCP; the chat-template start, or 0). An atom is a
maximal run of a microbatch's members (in lexicographic order) whose neighbours outside the run share only f with it.
Taking an atom A out of its microbatch removes exactly s(A) = work(A) - f, and adding it to another microbatch adds at
most s(A), so moving atoms never increases the total work (HARTS eq. 4's first objective) while it can even out the
microbatches, which lowers the other two objectives (the slots' heaviest microbatches and the heaviest replica).
"""

from __future__ import annotations

import numpy as np

from planner.microbatch.refine import Grouping

__all__ = ["balance_atoms"]


def _atoms(g: Grouping, floor: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All atoms: (atom id of each rank [N], microbatch of each atom [A], s(A) [A])."""
    index = g.index
    order = np.lexsort((np.arange(index.size), g.owner))  # members of each microbatch, in rank order
    same = g.owner[order[1:]] == g.owner[order[:-1]]
    starts = np.ones(index.size, dtype=bool)
    starts[1:] = ~same
    inner = np.flatnonzero(same) + 1
    starts[inner] = index.pair_lcp(order[inner - 1], order[inner]) <= floor
    atom_sorted = np.cumsum(starts) - 1
    atom = np.empty(index.size, dtype=np.int64)
    atom[order] = atom_sorted
    first = order[starts]
    # s(A) = work(A) - f: lengths of the members minus the LCPs inside the atom, minus f.
    inside = np.zeros(index.size, dtype=np.int64)
    inside[inner] = index.pair_lcp(order[inner - 1], order[inner])
    inside[starts] = 0
    size = np.bincount(atom_sorted, weights=index.lengths[order] - inside).astype(np.int64) - floor
    return atom, g.owner[first], size


def balance_atoms(g: Grouping, capacity: int, max_moves: int = 2000) -> Grouping:
    """Repeatedly move the atom that most reduces the sum of squared microbatch works into the lightest microbatch
    (it must fit, and its microbatch must keep another atom). Returns a new grouping with total work <= the input's
    (an atom that shares more than f with its new microbatch adds less than s(A))."""
    g = g.copy()
    index = g.index
    floor = int(index.lcp[1:].min()) if index.size > 1 else 0
    atom, atom_mb, size = _atoms(g, floor)
    count = np.bincount(atom_mb, minlength=g.k)
    for _ in range(max_moves):
        order = np.argsort(g.work, kind="stable")
        lightest, second = order[0], order[1] if g.k > 1 else order[0]
        target = np.where(atom_mb == lightest, second, lightest)
        gain = size * (g.work[atom_mb] - g.work[target] - size)
        ok = (count[atom_mb] >= 2) & (g.work[target] + size <= capacity) & (gain > 0)
        if not ok.any():
            break
        a = int(np.flatnonzero(ok)[np.argmax(gain[ok])])
        src, dst = int(atom_mb[a]), int(target[a])
        g.owner[atom == a] = dst
        g.work[src] -= size[a]
        before = g.work[dst]
        g.work[dst] = index.set_work(np.flatnonzero(g.owner == dst))
        if g.work[dst] - before < size[a]:  # it shares more than f there: it merged with an atom of dst
            atom, atom_mb, size = _atoms(g, floor)
            count = np.bincount(atom_mb, minlength=g.k)
        else:
            atom_mb[a] = dst
            count[src] -= 1
            count[dst] += 1
    return g
