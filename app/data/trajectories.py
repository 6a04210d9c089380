"""An offline job's trajectories: records of `[data] trajectories` (TRAJ.jsonl lines, planner/jsonl.py) through a
RecordFeed, each checked for the fields its objective trains on, in whole trees.

The feed's unit is a tree: the maximal run of consecutive lines of one file with the same `tree` id; a record
without one is a tree of one path (app.data.source.record_units). Shuffle, epochs, bad records (the whole tree is
skipped) and the checkpointed position count trees, and a step takes `train.trees_per_step` of them; without it a
step takes `train.trajectories_per_step` records, which only works when no tree has two paths.

    sft                      tokens (loss_mask, weight optional)
    rl                       + advantage
    rl, rl.tis_cap set       + logprobs        (behaviour log-probs of the truncated importance weights)
    rl, rl.kl_coef > 0       + ref_logprobs    (reference log-probs of the KL term)

A record that is no trajectory (planner/jsonl.py: also a NaN or inf advantage, weight or log-prob, or a positive
log-prob), lacks a field the objective needs, or holds a path longer than a `PathLimit` is a bad record (its file,
line and field; `data.on_bad_record`). The path limits are the model's `max_position_embeddings` and, where the plan
runs every path whole in one microbatch (duplicate mode), `planner.capacity`; in carry and auto mode the planner
cuts paths (and trees) of any length across microbatches. A path is measured before it is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

from app.data.config import DataConfig
from app.data.feed import RecordFeed, open_stream
from app.errors import ConfigError
from app.objectives import PolicyLossConfig
from planner.jsonl import TrajectoryRecordError, parse_record
from planner.step_plan import longest_trajectory
from planner.trajectory import Trajectory
from rollout.envs.records import RecordError

__all__ = ["PathLimit", "path_limits", "needed_fields", "trajectory_parser", "build_trajectory_feed"]


def needed_fields(objective: Literal["sft", "rl"], rl: PolicyLossConfig) -> dict[str, str]:
    """The optional TRAJ.jsonl keys `objective` needs, each with the setting that needs it."""
    if objective == "sft":
        return {}
    fields = {"advantage": "job.objective = 'rl' trains on the recorded advantages"}
    if rl.tis_cap is not None:
        fields["logprobs"] = f"rl.tis_cap = {rl.tis_cap} weights tokens by the behaviour log-probs (or set it to none)"
    if rl.kl_coef > 0:
        fields["ref_logprobs"] = f"rl.kl_coef = {rl.kl_coef} needs the reference log-probs"
    return fields


@dataclass(frozen=True)
class PathLimit:
    """The most tokens a path may have, and what sets that limit with the fix ("the model's
    max_position_embeddings 4096: shorten or drop it")."""

    tokens: int
    reason: str


def path_limits(max_positions: int, capacity: int, plan_mode: str) -> list[PathLimit]:
    """The limits of a path for a model of `max_positions` positions (`max_position_embeddings`), planned in
    `plan_mode` (the job's planner mode) with microbatches of `capacity` tokens."""
    limits = [PathLimit(max_positions, f"the model's max_position_embeddings {max_positions}: shorten or drop it")]
    limit = longest_trajectory(plan_mode, capacity)
    if limit is not None:
        limits.append(PathLimit(limit, (
            f"planner.capacity = {capacity}: duplicate mode runs every path whole in one microbatch (a tree may span "
            "several); shorten or drop it, raise planner.capacity to at least its length, or set planner.mode = "
            "'carry' or 'auto' (without pipeline parallelism), which cut paths")))
    return limits


def check_path_length(record: dict, limits: Sequence[PathLimit]) -> None:
    """Raise RecordError (field 'tokens') when the record's `tokens` list is longer than one of `limits`; reads only
    its length, so a huge record is refused before anything is built from it."""
    tokens = record.get("tokens")
    if not isinstance(tokens, list):
        return
    for limit in limits:
        if len(tokens) > limit.tokens:
            raise RecordError(f"path of {len(tokens):,} tokens exceeds {limit.reason}", field="tokens")


def trajectory_parser(needs: dict[str, str], vocab_size: int, limits: Sequence[PathLimit]
                      ) -> Callable[[dict], Trajectory]:
    """A record dict -> Trajectory; raises RecordError naming the key (also for a missing key of `needs`, for token
    ids the model's `vocab_size` does not have, and for a path longer than one of `limits`)."""

    def parse(record: dict) -> Trajectory:
        check_path_length(record, limits)
        try:
            trajectory = parse_record(record)
        except TrajectoryRecordError as e:
            raise RecordError(str(e), field=e.field) from None
        largest = int(trajectory.tokens.max())
        if largest >= vocab_size:
            raise RecordError(f"token id {largest} is outside the model's vocabulary of {vocab_size} ids "
                              "(the records must be tokenized with the model's tokenizer)", field="tokens")
        for key, why in needs.items():
            if record.get(key) is None:
                raise RecordError(f"missing: {why}", field=key)
        return trajectory

    return parse


def build_trajectory_feed(config: DataConfig, objective: Literal["sft", "rl"], rl: PolicyLossConfig, *,
                          vocab_size: int, limits: Sequence[PathLimit], seed: int, whole_trees: bool,
                          on_skip: Callable[[str], None] | None = None) -> RecordFeed:
    """The feed of `config.trajectories` for `objective` and a model of `vocab_size` ids (seed: the shuffle's when
    `config.seed` is unset); each batch item is a tree, a list of its paths (Trajectory) in file order.

    Args:
        limits: the path limits (`path_limits`); a longer path is a bad record.
        whole_trees: steps count trees (`train.trees_per_step` is set), not records.

    Raises:
        ConfigError: not `whole_trees`, and a tree has two paths or more (a step of records would split it).
        DataError: the files cannot be read, hold no records, or a tree's lines are not consecutive.
    """
    parse = trajectory_parser(needed_fields(objective, rl), vocab_size, limits)
    stream = open_stream(config, "trajectories", parse, seed=seed, on_skip=on_skip, group="tree")
    if whole_trees:
        return RecordFeed(stream, records="trees", items="trees")
    source = stream.source
    sizes = source.bounds[1:] - source.bounds[:-1]
    split = np.flatnonzero(sizes > 1)
    if len(split):
        file, rows = source.rows(int(split[0]))
        raise ConfigError(f"{file.where(rows[0])} begins a tree of {len(rows)} paths (records with one `tree` id): "
                          "train.trajectories_per_step would split trees across steps; set train.trees_per_step "
                          "(whole trees per step) instead")
    return RecordFeed(stream, records="trajectory records", items="records")
