"""HARTS Algorithm 1 (planner/calls/min_calls.py, planner/calls/schedule.py) against a brute force and the paper's
worked cases."""

import itertools

import numpy as np
import pytest

from planner.calls.min_calls import direct_children, mandatory_replay, min_calls
from planner.calls.schedule import min_call_schedule, schedule_sequences
from planner.calls.segment_tree import SegmentTree


def brute_force(tree: SegmentTree, B: int, max_delay: int = 0) -> dict:
    """Every direct-child choice and every start-round delay in [0, max_delay], simulated from the execution model.

    A sequence Q starts at anchor A_Q from the state at A_Q on its path. A side branch of v (in sequence P) needs
    the state at b = floor(e_v/B)*B: if b == A_P it is P's own initial state (available when P's was), otherwise P
    computes it and it is available from the round after P runs. Returns {direct choice: (min rounds, replay)}.
    """
    parent, start, end = tree.parent.tolist(), tree.start.tolist(), tree.end.tolist()
    kids = [[] for _ in parent]
    for g, p in enumerate(parent):
        if p >= 0:
            kids[p].append(g)
    internal = [v for v in range(len(parent)) if kids[v]]
    out = {}
    for choice in itertools.product(*(kids[v] for v in internal)):
        direct = dict(zip(internal, choice))
        # (anchor, producer sequence or -1 for the zero state, state position, first segment)
        seqs = [(0, -1, 0, r) for r, p in enumerate(parent) if p < 0]
        n = 0
        while n < len(seqs):
            v = seqs[n][3]
            while True:
                for u in kids[v]:
                    if u != direct[v]:
                        seqs.append((end[v] // B * B, n, end[v] // B * B, u))
                if not kids[v]:
                    break
                v = direct[v]
            n += 1
        replay = sum(start[first] - anchor for anchor, _, _, first in seqs)
        best = None
        for delays in itertools.product(range(max_delay + 1), repeat=len(seqs)):
            ready, run = [], []
            for (anchor, src, pos, _), delay in zip(seqs, delays):
                if src < 0:
                    ready.append(1)
                elif pos == seqs[src][0]:
                    ready.append(ready[src])
                else:
                    ready.append(run[src] + 1)
                run.append(ready[-1] + delay)
            best = max(run) if best is None else min(best, max(run))
        out[choice] = (best, replay)
    return out


def all_shapes(max_segments):
    """Every rooted tree with segments numbered parent-first: parent[i] in [0, i)."""
    for n in range(1, max_segments + 1):
        yield from (((-1,) + p) for p in itertools.product(*(range(i) for i in range(1, n))))


def check_against_brute_force(tree, B, max_delay):
    schedule = min_call_schedule(tree, B)
    results = brute_force(tree, B, max_delay)
    best = min(rounds for rounds, _ in results.values())
    assert schedule.num_rounds == best, (tree.parent, tree.start, tree.end, schedule.num_rounds, best)
    # R does not depend on the direct children (eq. 15), and the planner's own choice runs in its stated rounds.
    assert {replay for _, replay in results.values()} == {mandatory_replay(tree, B)} == {schedule.total_replay}
    internal = [v for v in range(tree.num_segments) if schedule.direct_child[v] >= 0]
    assert results[tuple(schedule.direct_child[internal].tolist())][0] == schedule.num_rounds


def test_optimal_on_all_small_trees():
    """All 874 tree shapes with <= 7 segments, 4 random token draws each (B = 4, forks around chunk boundaries)."""
    rng = np.random.default_rng(0)
    checked = 0
    for parent in all_shapes(7):
        for _ in range(4):
            tree = SegmentTree.from_lengths(parent, rng.integers(1, 10, size=len(parent)))
            check_against_brute_force(tree, 4, max_delay=0)
            checked += 1
    assert checked == 874 * 4


def test_optimal_over_start_rounds_on_tiny_trees():
    """Delaying any sequence never beats the plan: every start round in [earliest, earliest + 2], <= 5 segments."""
    rng = np.random.default_rng(1)
    for parent in all_shapes(5):
        for _ in range(3):
            tree = SegmentTree.from_lengths(parent, rng.integers(1, 10, size=len(parent)))
            check_against_brute_force(tree, 4, max_delay=2)


def test_optimal_on_random_larger_trees():
    rng = np.random.default_rng(2)
    for _ in range(150):
        G = int(rng.integers(8, 12))
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, G)]
        B = int(rng.choice([2, 4, 8]))
        tree = SegmentTree.from_lengths(parent, rng.integers(1, 3 * B, size=G))
        check_against_brute_force(tree, B, max_delay=0)


def fork_tree(B, p, side_tokens=5):
    """v0 = [0, p) forks into v1 and v2 (leaves)."""
    return SegmentTree.from_lengths([-1, 0, 0], [p, 7, side_tokens])


@pytest.mark.parametrize("offset, replay, side_round", [(-1, 63, 0), (0, 0, 1), (1, 1, 1)], ids=["B-1", "B", "B+1"])
def test_figure_2b_boundary_cases(offset, replay, side_round):
    B = 64
    schedule = min_call_schedule(fork_tree(B, B + offset), B)
    assert schedule.segments_of(0).tolist() == [0, 1]
    side = int(schedule.seg_sequence[2])
    assert (schedule.seq_replay[side], schedule.seq_round[side]) == (replay, side_round)
    assert schedule.seq_anchor[side] == (B + offset) // B * B
    assert schedule.num_rounds == side_round + 1 and schedule.total_replay == replay


def test_forks_inside_the_first_chunk_run_in_one_round():
    """Forks at p < B in the root start from the zero state in the same call, however deeply nested."""
    B = 64
    tree = SegmentTree.from_lengths([-1, 0, 0, 1, 1, 3, 3], [5, 3, 80, 4, 200, 2, 9])
    schedule = min_call_schedule(tree, B)
    assert schedule.num_rounds == 1
    assert (schedule.seq_anchor == 0).all() and (schedule.seq_source == -1).all()
    assert schedule.total_replay == 5 + 8 + 12


def test_figure_2a_tree_plans_in_two_rounds():
    B = 64
    # v0 = [0, B-1) forks into v1, v2; v1 = [B-1, B+1) forks into v3, v4.
    tree = SegmentTree.from_lengths([-1, 0, 0, 1, 1], [B - 1, 2, 10, 5, 7])
    t_pre, t_in = min_calls(tree, B)
    assert t_pre.tolist() == [2, 2, 1, 1, 1] and t_in.tolist() == [2, 2, 1, 1, 1]
    s = min_call_schedule(tree, B)
    assert direct_children(tree, B, t_pre, t_in).tolist() == [1, 3, -1, -1, -1]
    got = [(int(s.seq_round[n]), s.segments_of(n).tolist(), int(s.seq_replay[n])) for n in range(3)]
    assert got == [(0, [0, 1, 3], 0), (0, [2], B - 1), (1, [4], 1)]
    assert s.num_rounds == 2 and s.total_replay == B


def test_chain_is_one_round():
    tree = SegmentTree.from_lengths([-1, 0, 1, 2, 3], [100, 1, 64, 300, 7])  # single-child links: no fork
    schedule = min_call_schedule(tree, 64)
    assert schedule.num_rounds == 1 and schedule.num_sequences == 1 and schedule.total_replay == 0
    assert schedule.segments_of(0).tolist() == [0, 1, 2, 3, 4]


def test_high_fan_out():
    B, k = 64, 50
    shallow = SegmentTree.from_lengths([-1] + [0] * k, [10] + [100] * k)  # fork at 10 < B: all in round 1
    s = min_call_schedule(shallow, B)
    assert (s.num_rounds, s.num_sequences, s.total_replay) == (1, k, (k - 1) * 10)
    deep = SegmentTree.from_lengths([-1] + [0] * k, [130] + [100] * k)  # fork at 130: side branches wait one round
    s = min_call_schedule(deep, B)
    assert (s.num_rounds, s.num_sequences, s.total_replay) == (2, k, (k - 1) * 2)
    assert (s.seq_round[1:] == 1).all() and (s.seq_source[1:] == 0).all() and (s.seq_anchor[1:] == 128).all()


def test_several_trees_merge_by_round():
    B = 64
    # tree 0: fork at B+1 (2 rounds); tree 1: one segment (1 round); tree 2: forks at 70 and 140 (3 rounds).
    trees = [([-1, 0, 0], [B + 1, 3, 3]), ([-1], [500]), ([-1, 0, 0, 1, 1, 2, 2], [70, 70, 70, 5, 5, 5, 5])]
    assert [min_call_schedule(SegmentTree.from_lengths(p, n), B).num_rounds for p, n in trees] == [2, 1, 3]
    parent = [-1, 0, 0, -1, -1, 4, 4, 5, 5, 6, 6]
    tree = SegmentTree.from_lengths(parent, [n for _, lengths in trees for n in lengths])
    s = min_call_schedule(tree, B)
    assert s.num_rounds == 3 and s.total_replay == 1 + 6 + 12 + 12
    rounds = {g: int(s.seq_round[s.seg_sequence[g]]) for g in range(tree.num_segments)}
    assert rounds == {0: 0, 1: 0, 2: 1, 3: 0, 4: 0, 5: 0, 6: 1, 7: 0, 8: 1, 9: 1, 10: 2}
    assert s.seq_round.tolist() == sorted(s.seq_round.tolist())


def test_several_trees_rounds_are_per_tree_optimal():
    rng = np.random.default_rng(3)
    trees = []
    for _ in range(4):
        G = int(rng.integers(1, 8))
        trees.append(([-1] + [int(rng.integers(0, i)) for i in range(1, G)], rng.integers(1, 12, size=G)))
    offsets = np.cumsum([0] + [len(p) for p, _ in trees])
    parent = np.concatenate([np.where(np.asarray(p) >= 0, np.asarray(p) + o, -1) for (p, _), o in zip(trees, offsets)])
    forest = SegmentTree.from_lengths(parent, np.concatenate([l for _, l in trees]))
    s = min_call_schedule(forest, 4)
    for (p, l), o in zip(trees, offsets):
        alone = min_call_schedule(SegmentTree.from_lengths(p, l), 4)
        merged_rounds = s.seq_round[s.seg_sequence[o : o + len(p)]]
        assert merged_rounds.max() + 1 == alone.num_rounds
        assert (merged_rounds == alone.seq_round[alone.seg_sequence]).all()


def test_replay_is_independent_of_direct_children():
    """Random direct choices on random trees of 200 segments: replay always equals eq. 15; rounds never beat T_pre."""
    rng = np.random.default_rng(4)
    for _ in range(20):
        G = 200
        tree = SegmentTree.from_lengths([-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, G)],
                                        rng.integers(1, 90, size=G))
        best = min_call_schedule(tree, 64)
        kids = [tree.children[tree.child_offsets[v] : tree.child_offsets[v + 1]] for v in range(G)]
        for _ in range(5):
            direct = np.array([rng.choice(k) if k.size else -1 for k in kids])
            s = schedule_sequences(tree, 64, direct)
            assert s.total_replay == best.total_replay == mandatory_replay(tree, 64)
            assert s.num_rounds >= best.num_rounds


def test_deep_chain_of_forks_is_iterative():
    """A caterpillar 20k forks deep (Python recursion would fail). Forks sit on chunk boundaries: the spine is one
    sequence and every leaf waits one round for its boundary state, so 2 rounds and no replay."""
    depth = 20_000
    parent = [-1] + [2 * ((i - 1) // 2) for i in range(1, 2 * depth + 1)]  # spine 0, 2, 4, ...; leaves 1, 3, 5, ...
    tree = SegmentTree.from_lengths(parent, [64] * (2 * depth + 1))
    s = min_call_schedule(tree, 64)
    assert s.num_rounds == 2 and s.total_replay == 0 and s.num_sequences == depth + 1


# ---- HARTS Appendix A (B = 64). Trees reconstructed from the figure text: the chains listed in each caption give the
# direct edges, and every side branch hangs from the segment whose end mod 64 equals its replay label (each such label
# fits exactly one candidate, except where noted). Nodes: (name, parent, tokens), direct child listed first.

CASE_I = """R1 - 3; A1 R1 2; B1 R1 632; C1 R1 255; A2 A1 403; A3 A1 10; A4 A3 7753; A5 A3 21119; A6 A4 1355;
A7 A4 2; A8 A7 1; A9 A7 3588; A10 A8 29628; A11 A8 3604; B2 B1 1; B3 B1 15; B4 B2 10; B5 B2 14; B6 B4 13; B7 B4 6;
B8 B7 13; B9 B7 11; C2 C1 1; C3 C1 45; C4 C2 10; C5 C2 27; C6 C4 110; C7 C4 6; C8 C6 630; C9 C6 630; C10 C7 116;
C11 C7 553; C12 C10 435; C13 C10 427; C14 C5 189; C15 C5 187"""
CASE_I_CALLS = [
    "R1 A1 A2 0; A3 A4 A6 5; A5 15; B1 B2 B4 B6 3; C1 C2 C4 C6 C8 3",
    "A7 A8 A10 24; A11 27; A9 26; B7 B8 6; B9 12; B5 60; B3 59; C9 59; C7 C10 C12 13; C11 19; C5 C14 3; C15 30; C3 2",
    "C13 7",
]

# E11-E15 end at 637 and hang from E2 or E3 (both [636, 637)); F10-F15 from F2 or F3 (both [259, 260)). The text does
# not say which; both placements are tested and give the same calls.
CASE_II = """R2 - 3; D1 R2 2; E1 R2 633; F1 R2 256; D2 D1 399; D3 D1 16884; D5 D3 10346; D4 D3 59; D7 D5 6555;
D6 D5 133; D8 D7 1902; D9 D7 70; E2 E1 1; E3 E1 1; E4 E1 15; E5 E1 15; E6 E2 2; E7 E2 15; E8 E6 13; E9 E6 14;
E10 E3 15; E11 Ex 15; E12 Ex 16; E13 Ex 15; E14 Ex 15; E15 Ex 14; F5 F1 445; F2 F1 1; F3 F1 1; F4 F1 170; F16 F5 10;
F17 F5 5; F6 F2 2; F7 F6 220; F8 F6 212; F9 F3 155; F10 Fx 346; F11 Fx 1469; F12 Fx 390; F13 Fx 168; F14 Fx 335;
F15 Fx 226"""
CASE_II_CALLS = [
    "R2 D1 D2 0; D3 D5 D7 D8 5; E1 E2 E6 E8 3; F1 F5 F16 3",
    "D4 57; D6 35; D9 62; E9 63; E7 61; E3 E10 60; E11 61; E12 61; E13 61; E14 61; E15 61; E4 60; E5 60; "
    "F2 F6 F7 3; F8 6; F3 F9 3; F10 4; F11 4; F12 4; F13 4; F14 4; F15 4; F4 3; F17 0",
]

_G_TOKENS = [13257, 585, 251, 480, 225, 644, 319, 999, 49, 772, 485, 1527, 38, 116, 63, 39239, 76, 477, 222, 3247, 765,
             838, 550, 909, 799, 2111, 867, 874, 395, 1773, 962, 1592, 583]  # G3 .. G35
_G_SPINE = ["G3", "G4"] + [f"G{i}" for i in range(6, 35, 2)]
_G_PARENT = {"G3": "G1", "G4": "G3", "G5": "G3", **{f"G{i}": _G_SPINE[(i - 6) // 2 + 1] for i in range(6, 36)}}
_G_PARENT.update({f"G{i}": _G_SPINE[(i - 7) // 2 + 1] for i in range(7, 36, 2)})
CASE_III = "R3 - 3; G1 R3 2; H1 R3 633; I1 R3 256; G2 G1 397; " + "; ".join(
    f"G{i} {_G_PARENT[f'G{i}']} {t}" for i, t in zip(range(3, 36), _G_TOKENS)
) + "; H2 H1 1; H3 H1 15; H4 H1 15; H5 H2 14; H6 H2 15; I2 I1 1; I3 I1 943; I4 I1 282; I5 I2 1243; I6 I2 410"
CASE_III_CALLS = [
    "R3 G1 G2 0; " + " ".join(_G_SPINE) + " 5; H1 H2 H5 3; I1 I2 I5 3",
    "G35 13; G33 32; G31 54; G29 55; G27 42; G25 36; G23 53; G21 24; G19 17; G17 29; G15 38; G13 34; G11 59; G9 55; "
    "G7 23; G5 14; H6 61; H3 60; H4 60; I6 4; I3 3; I4 3",
]


def parse_case(text):
    nodes = [item.split() for item in text.replace("\n", " ").split(";")]
    names = [n for n, _, _ in nodes]
    index = {n: i for i, n in enumerate(names)}
    parent = [-1 if p == "-" else index[p] for _, p, _ in nodes]
    return SegmentTree.from_lengths(parent, [int(t) for _, _, t in nodes], names=names)


def members(schedule):
    """{(call, chain of names, replay)} of a schedule, calls from 1."""
    names = schedule.tree.names
    return {
        (int(schedule.seq_round[n]) + 1, tuple(names[g] for g in schedule.segments_of(n)), int(schedule.seq_replay[n]))
        for n in range(schedule.num_sequences)
    }


def expected_members(calls):
    out = set()
    for call, text in enumerate(calls, start=1):
        for item in text.split(";"):
            *chain, replay = item.split()
            out.add((call, tuple(chain), int(replay)))
    return out


@pytest.mark.parametrize(
    "text, calls, rounds, replay, round_replay",
    [
        (CASE_I, CASE_I_CALLS, 3, 373, [26, 340, 7]),
        (CASE_II.replace("Ex", "E3").replace("Fx", "F3"), CASE_II_CALLS, 2, 813, [11, 802]),
        (CASE_II.replace("Ex", "E2").replace("Fx", "F2"), CASE_II_CALLS, 2, 813, [11, 802]),
        (CASE_III, CASE_III_CALLS, 2, 780, [11, 769]),
    ],
    ids=["case-I", "case-II-under-E3-F3", "case-II-under-E2-F2", "case-III"],
)
def test_appendix_a_cases(text, calls, rounds, replay, round_replay):
    tree = parse_case(text)
    schedule = min_call_schedule(tree, 64)
    assert schedule.num_rounds == rounds
    assert schedule.total_replay == mandatory_replay(tree, 64) == replay
    assert schedule.round_replay.tolist() == round_replay
    assert members(schedule) == expected_members(calls)


def test_schedule_rejects_an_illegal_direct_choice():
    tree = SegmentTree.from_lengths([-1, 0, 0], [5, 1, 1])
    with pytest.raises(ValueError, match="must name one of them"):
        schedule_sequences(tree, 64, [2, 0, -1])
    with pytest.raises(ValueError, match="must name one of them"):
        schedule_sequences(tree, 64, [-1, -1, -1])
    with pytest.raises(ValueError, match="not a segment id"):
        schedule_sequences(tree, 64, [7, -1, -1])
    with pytest.raises(ValueError, match="all -1"):
        schedule_sequences(tree, 64, [1, -1, -1], replay=False)
    with pytest.raises(ValueError, match="chunk_size"):
        min_call_schedule(tree, 0)
