"""planner.cost_model: the tree-versus-flat and carry-versus-duplicate choices."""

import numpy as np

from planner.cost_model import CostModel


def test_runs_flat_when_the_expansion_is_strictly_faster_shares_nothing_lost_and_fits():
    cost = CostModel(expansion_per_token=1.0, tree_per_compact=2.0, tree_per_view_row=0.5)
    assert cost.tree_seconds(10, 10) == 25.0 and cost.expansion_seconds(25) == 25.0
    assert not cost.runs_flat(10, 10, 25, 100)  # a tie keeps the trie
    assert cost.runs_flat(10, 12, 25, 100)
    assert not cost.runs_flat(10, 12, 25, 24)  # the expansion would not fit the capacity
    assert not CostModel(expansion_per_token=0.0).runs_flat(25, 25, 25, 100)  # nothing shared: nothing to expand


def test_an_unmeasured_expansion_costs_what_the_tree_path_costs_per_row_and_view_row():
    cost = CostModel()
    assert cost.expansion_per_token is None
    assert cost.expansion_seconds(100) == 100 * (cost.tree_per_compact + cost.tree_per_view_row)
    # A trie sharing 1% of its tokens, its view rows its tokens: kept. Twice as many view rows as tokens would flip
    # it (a shape replay never makes: its sequences end at leaves).
    assert not cost.runs_flat(99, 100, 100, 1000) and cost.runs_flat(99, 200, 100, 1000)


def test_prefers_carry_weighs_views_and_context_against_duplicated_rows():
    cost = CostModel(tree_per_compact=4.0, tree_per_view_row=1.0, carry_per_context_row=1.0)
    assert cost.carry_seconds(3, 4) == 7.0 and cost.duplicate_seconds(2) == 8.0
    assert cost.prefers_carry(3, 4, 2)
    assert not cost.prefers_carry(3, 5, 2)


def test_refit_from_bench_speed_keys():
    """bench.speed.fit_cost_model's dict builds a model; the carry coefficient keeps its default."""
    fitted = {"expansion_per_token": 6e-5, "tree_per_compact": 5e-5, "tree_per_view_row": 7e-6}
    cost = CostModel(**fitted)
    assert cost.tree_per_view_row == 7e-6 and cost.carry_per_context_row == CostModel().carry_per_context_row


def test_plan_seconds_charges_the_heaviest_microbatch_of_each_slot():
    cost = CostModel(tree_per_compact=1.0, tree_per_view_row=1.0, carry_per_context_row=1.0)
    slot_rows = np.array([[10, 7], [4, 6]])
    assert cost.plan_seconds(slot_rows, 3, 1) == 10 + 6 + (3 + 1) / 2


def test_defaults_are_the_fit_of_the_recorded_h200_steps():
    """The defaults reproduce their measurements (docs/history.md; rows, view rows and context rows
    from the plans of `bench.workloads.swe_like_step` at scale 0.01, capacity 65,536): seed 5's three HARTS
    microbatches, its carry step and seed 4's, full recomputation, within 0.3%; and the least-squares fit of those
    points is the defaults to 3 digits."""
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

