"""A linear cost model of one microbatch's forward + backward + gradient, for the planner's execution choices.

Two choices of auto mode use it, both made by the planner: whether a planned microbatch runs as a tree or as its
flat expansion (`runs_flat`, planner/microbatch/flat.py), and whether a tree larger than a microbatch is carried
across microbatches or split by whole trajectories with its shared prefixes duplicated (`prefers_carry`,
planner/step_plan.py).

Defaults: a least-squares fit through the origin on one H200, ling-3-tiny in bf16 with full-layer recomputation and
branch attention, SWE seeds 5 and 4 at scale 0.01, capacity 65,536 (measured runs: docs/history.md): the three
microbatches of seed 5's HARTS plan (5.09, 5.01, 4.00 s), seed 5's carry step (2 microbatches, 9.96 s) and seed
4's (6 microbatches, 28.72 s, with every open microbatch resident: 29.54 s at the job's default of 1) give 72.64 us
per compact row + 1.376 us per attention-view row + 6.07 us per carried context row, each step within 0.3% of its
measurement (a joint fit, in-sample: 3 coefficients on 5 steps from commits 766f733 and de3af4f;
`tests/planner/test_cost_model.py`). `bench.speed` refits them per GPU and model (`fit_cost_model`: the tree terms
on the HARTS microbatches, then the context term on what the carry step takes beyond them, which on these five
gives 73.13, 1.303 and 6.55 us) and a job takes them as `[planner.cost]`.

A flat expansion (`planner.pack.pack(share=False)`) runs through the tree path with ancestor-free views; its cost
per token (`expansion_per_token`) has no GPU measurement yet, so by default it is the tree path's cost per row plus
per view row (each of its rows is one view row): a trie, which has at most as many rows, is then slower only when
its view rows outnumber its tokens, and with replay they never do (every sequence ends at a leaf, so its view rows
sum the leaf trajectories' lengths): nothing runs flat until `bench.speed` has measured an expansion
(`expansion_per_token` in its fit).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostModel"]


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Seconds per unit of work (see the module docstring for where the defaults come from)."""

    expansion_per_token: float | None = None
    """A microbatch run as its flat expansion (through the tree path): seconds per token; None: not measured, taken
    as `tree_per_compact + tree_per_view_row`."""
    tree_per_compact: float = 72.64e-6
    """Tree execution: seconds per compact row (every layer's per-row work)."""
    tree_per_view_row: float = 1.376e-6
    """Tree execution: seconds per row of the full-attention branch views (every branch reads its whole path)."""
    carry_per_context_row: float = 6.07e-6
    """Carry mode: seconds per context row a part reads from earlier microbatches (its keys/values exported once,
    gathered by the consumer, their gradients accumulated and injected into the producer's backward, and held in
    memory between the two). `bench.speed` refits it when it runs flat, duplicate and carry with auto mode and the
    carry step carried context (`carry_context_cost`)."""

    def tree_seconds(self, compact_rows: int, view_rows: int) -> float:
        return self.tree_per_compact * compact_rows + self.tree_per_view_row * view_rows

    def expansion_seconds(self, semantic_tokens: int) -> float:
        """A microbatch of `semantic_tokens` tokens run as its flat expansion."""
        per_token = self.expansion_per_token
        if per_token is None:
            per_token = self.tree_per_compact + self.tree_per_view_row
        return per_token * semantic_tokens

    def runs_flat(self, compact_rows: int, view_rows: int, semantic_tokens: int, capacity: int) -> bool:
        """Whether a microbatch whose trie has `compact_rows` rows and `view_rows` branch-view rows and whose
        trajectories hold `semantic_tokens` tokens runs as its flat expansion: the trie shares something, the
        expansion is predicted strictly faster (`expansion_seconds` < `tree_seconds`; a tie keeps the trie) and its
        rows fit the microbatch `capacity` (a microbatch's memory budget)."""
        return (compact_rows < semantic_tokens <= capacity
                and self.expansion_seconds(semantic_tokens) < self.tree_seconds(compact_rows, view_rows))

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
