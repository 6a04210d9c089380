"""planner.cost_model: the tree-versus-flat and carry-versus-duplicate choices."""

import numpy as np

from planner.cost_model import CostModel


def test_prefers_tree_compares_predicted_seconds():
    cost = CostModel(flat_per_token=1.0, tree_per_compact=2.0, tree_per_view_row=0.5)
    assert cost.tree_seconds(10, 10) == 25.0 and cost.flat_seconds(25) == 25.0
    assert cost.prefers_tree(10, 10, 25)  # a tie runs as a tree
    assert not cost.prefers_tree(10, 12, 25)


def test_prefers_carry_weighs_views_and_context_against_duplicated_rows():
    cost = CostModel(tree_per_compact=4.0, tree_per_view_row=1.0, carry_per_context_row=1.0)
    assert cost.carry_seconds(3, 4) == 7.0 and cost.duplicate_seconds(2) == 8.0
    assert cost.prefers_carry(3, 4, 2)
    assert not cost.prefers_carry(3, 5, 2)


def test_refit_from_bench_speed_keys():
    """bench.speed.fit_cost_model's dict builds a model; the carry coefficient keeps its default."""
    fitted = {"flat_per_token": 6e-5, "tree_per_compact": 5e-5, "tree_per_view_row": 7e-6}
    cost = CostModel(**fitted)
    assert cost.tree_per_view_row == 7e-6 and cost.carry_per_context_row == CostModel().carry_per_context_row


def test_plan_seconds_charges_the_heaviest_microbatch_of_each_slot():
    cost = CostModel(tree_per_compact=1.0, tree_per_view_row=1.0, carry_per_context_row=1.0)
    slot_rows = np.array([[10, 7], [4, 6]])
    assert cost.plan_seconds(slot_rows, 3, 1) == 10 + 6 + (3 + 1) / 2


def test_defaults_are_the_fit_of_the_recorded_h200_steps():
    """The defaults reproduce their measurements (bench/RESULTS.md, sessions 8-9; rows, view rows and context rows
    from the plans of `bench.workloads.swe_like_step` at scale 0.01, capacity 65,536): seed 5's three HARTS
    microbatches, its carry step and seed 4's, full recomputation, within 0.3%; and the least-squares fit of those
    points is the defaults to 3 digits. Flat: 80.41 s over 1,180,320 tokens."""
    steps = [  # (compact rows, view rows, context rows, seconds)
        (61_581, 446_953, 0, 5.09), (59_525, 506_079, 0, 5.01), (50_664, 227_288, 0, 4.00),
        (111_505, 1_211_398, 31_078, 9.96), (334_301, 2_738_505, 110_699, 28.72),
    ]
    cost = CostModel()
    for c, v, p, seconds in steps:
        predicted = cost.tree_seconds(c, v) + cost.carry_per_context_row * p
        assert abs(predicted - seconds) <= 0.003 * seconds, (c, predicted, seconds)
    x = np.array([s[:3] for s in steps], dtype=float)
    fit, *_ = np.linalg.lstsq(x, np.array([s[3] for s in steps]), rcond=None)
    defaults = [cost.tree_per_compact, cost.tree_per_view_row, cost.carry_per_context_row]
    assert np.allclose(fit, defaults, rtol=5e-3)
    assert abs(cost.flat_per_token - 80.41 / 1_180_320) <= 5e-3 * cost.flat_per_token
    # The break-even: a trie sharing less than about 8% of its tokens (its view rows = its tokens) runs flat.
    assert not cost.prefers_tree(93, 100, 100) and cost.prefers_tree(91, 100, 100)
