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
