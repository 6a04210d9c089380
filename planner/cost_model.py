"""A linear cost model of one microbatch's forward + backward + gradient, for the planner's execution choices.

Two choices use it: whether a planned microbatch runs as a tree or as its flat expansion (`runs_flat`,
`models.microbatch.prepare_microbatch`), and
whether a tree larger than a microbatch is carried across microbatches or split by whole trajectories with its
shared prefixes duplicated (`prefers_carry`, planner/step_plan.py).

Defaults: `bench.speed`'s fit (`fit_cost_model`, least squares through the origin over every measured microbatch)
on one H200, ling-3-tiny in bf16 with full-layer recomputation, SWE seed 0 at scale 0.01 plus the low-sharing
workload, code of commit 30c1685: bench/RESULTS.md, "GPU: compact log-probs accumulate in fp32 inside the GEMM
(issue 7) — session 5" (flat 63.39 us/token; tree 47.34 us/compact row + 6.20 us/attention-view row). A benchmark
refits it with `CostModel(**bench.speed.fit_cost_model(states))`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostModel"]


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Seconds per unit of work (see the module docstring for where the defaults come from)."""

    flat_per_token: float = 63.39e-6
    """Flat packed execution: seconds per token."""
    tree_per_compact: float = 47.34e-6
    """Tree execution: seconds per compact row (every layer's per-row work)."""
    tree_per_view_row: float = 6.20e-6
    """Tree execution: seconds per row of the full-attention branch views (every branch reads its whole path)."""
    carry_per_context_row: float = 6.20e-6
    """Carry mode: seconds per context row a part reads from earlier microbatches (its keys/values exported once,
    gathered by the consumer, their gradients accumulated and injected into the producer's backward, and held in
    memory between the two). Set to the cost of a view row, which moves the same keys and values once.
    `bench.speed` refits it when it runs flat, duplicate and carry with auto mode (`carry_context_cost`). Measured
    once (bench/RESULTS.md, session 9: SWE seed 5, 31,078 context rows): 12.0 us per context row over a refit of
    that run's three duplicate microbatches (65.1 us/row, 1.83 us/view row), i.e. 0.37 s of a 9.85 s carry step;
    at the defaults above the carry step runs 2.9 s faster than its rows and views predict (no context cost)."""

    def tree_seconds(self, compact_rows: int, view_rows: int) -> float:
        return self.tree_per_compact * compact_rows + self.tree_per_view_row * view_rows

    def flat_seconds(self, semantic_tokens: int) -> float:
        return self.flat_per_token * semantic_tokens

    def prefers_tree(self, compact_rows: int, view_rows: int, semantic_tokens: int) -> bool:
        """Whether a microbatch of `compact_rows` rows whose branch views hold `view_rows` rows, expanding to
        `semantic_tokens` flat tokens, is predicted at most as slow as a tree as flat."""
        return self.tree_seconds(compact_rows, view_rows) <= self.flat_seconds(semantic_tokens)

    def runs_flat(self, compact_rows: int, view_rows: int, semantic_tokens: int, capacity: int) -> bool:
        """Whether such a microbatch runs as its flat expansion: predicted faster than the trie (`prefers_tree`
        false) and its `semantic_tokens` rows within the microbatch `capacity` (the memory budget of a microbatch)."""
        return semantic_tokens <= capacity and not self.prefers_tree(compact_rows, view_rows, semantic_tokens)

    def carry_seconds(self, extra_view_rows: int, context_rows: int) -> float:
        """What carrying a tree over its parts adds: view rows of its cuts and the context rows its parts read."""
        return self.tree_per_view_row * extra_view_rows + self.carry_per_context_row * context_rows

    def duplicate_seconds(self, duplicated_rows: int) -> float:
        """What splitting a tree by whole trajectories adds: the shared-prefix rows executed again."""
        return self.tree_per_compact * duplicated_rows

    def plan_seconds(self, slot_rows, extra_view_rows: int, context_rows: int) -> float:
        """Predicted time of a step plan whose replicas run in lockstep: per slot the heaviest microbatch's rows
        (`slot_rows` [J, D], e.g. `CarryPlan.slot_work()`), plus what its cuts and carried context add, spread over
        the D replicas."""
        dp = slot_rows.shape[1]
        heaviest = float(slot_rows.max(axis=1).sum()) if slot_rows.size else 0.0
        return self.tree_per_compact * heaviest + self.carry_seconds(extra_view_rows, context_rows) / dp

    def prefers_carry(self, extra_view_rows: int, context_rows: int, duplicated_rows: int) -> bool:
        """Whether carrying a tree is predicted cheaper than duplicating its shared prefixes."""
        return self.carry_seconds(extra_view_rows, context_rows) < self.duplicate_seconds(duplicated_rows)
