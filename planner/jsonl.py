"""TRAJ.jsonl: trajectories as JSON lines.

One JSON object per line, one trajectory per object:

    {"tokens": [int, ...],            required, non-empty, ids in [0, 2**32)
     "tree": str | int,               optional rollout-tree id (a tree's paths are consecutive lines)
     "loss_mask": [0/1 or bool, ...], optional, one per token (default: every token but the first)
     "advantage": float | [float],    optional, finite, scalar or one per token (default 0)
     "logprobs": [float, ...],        optional behaviour log-probs, one per token, finite and <= 0
     "ref_logprobs": [float, ...],    optional reference log-probs, one per token, finite and <= 0
     "weight": float,                 optional trajectory loss weight, finite (default 1)
     "reward": float}                 optional trajectory reward

Blank lines are skipped. Any other key is an error (it is likely a typo of one of these). Every per-token value
counts, also where the loss mask is 0: the losses multiply by the mask, and NaN * 0 is NaN (a JSON `null` inside a
list reads as NaN).
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Iterable

import numpy as np

from planner.trajectory import Trajectory

__all__ = ["read_jsonl", "write_jsonl", "parse_record", "TrajectoryFileError", "TrajectoryRecordError"]

_KEYS = ("tokens", "tree", "loss_mask", "advantage", "logprobs", "ref_logprobs", "weight", "reward")
#: Per-token float keys: every entry must be finite.
_PER_TOKEN_VALUES = ("advantage", "logprobs", "ref_logprobs")
#: Per-token keys that are log-probabilities: every entry must also be <= 0.
_LOG_PROBS = ("logprobs", "ref_logprobs")


class TrajectoryFileError(ValueError):
    """A TRAJ.jsonl file that cannot be read; the message names the file, the line and the problem."""


class TrajectoryRecordError(TrajectoryFileError):
    """One record (a parsed line) that is not a trajectory; the message names the key, not where the record is.
    `field` is the offending key when the message does not name it already (None otherwise)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def describe(self) -> str:
        """The message with the field in front ("field 'weight': must be a finite number, got NaN")."""
        return f"field {self.field!r}: {self}" if self.field is not None else str(self)


def parse_record(obj) -> Trajectory:
    """One TRAJ.jsonl record (a JSON value) as a Trajectory; raises TrajectoryRecordError naming the key."""
    if not isinstance(obj, dict):
        raise TrajectoryRecordError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in _KEYS]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, _KEYS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (allowed: {', '.join(_KEYS)})"
        raise TrajectoryRecordError(f"unknown key '{key}'{hint}")
    if "tokens" not in obj:
        raise TrajectoryRecordError("missing required key 'tokens'")
    tokens = obj["tokens"]
    if not isinstance(tokens, list) or not tokens or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise TrajectoryRecordError("'tokens' must be a non-empty list of integers")
    tree = obj.get("tree")
    if tree is not None and (not isinstance(tree, (str, int)) or isinstance(tree, bool)):
        raise TrajectoryRecordError(f"'tree' must be a string or an integer id, got {json.dumps(tree)}")
    for key in ("loss_mask", "logprobs", "ref_logprobs"):
        if key in obj and not isinstance(obj[key], list):
            raise TrajectoryRecordError(f"'{key}' must be a list with one entry per token")
    for key in ("weight", "reward"):
        value = obj.get(key)
        missing = value is None and key == "reward"  # a null reward is no reward
        if key in obj and not missing and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise TrajectoryRecordError(f"'{key}' must be a number, got {json.dumps(value)}")
    try:
        trajectory = Trajectory(
            tokens=np.asarray(tokens, dtype=np.int64),
            loss_mask=obj.get("loss_mask"),
            advantage=obj.get("advantage"),
            logprobs=obj.get("logprobs"),
            ref_logprobs=obj.get("ref_logprobs"),
            weight=obj.get("weight", 1.0),
            reward=obj.get("reward"),
            tree=obj.get("tree"),
        )
    except (ValueError, TypeError, OverflowError) as e:
        # Trajectory's messages name the argument (the key) in backticks.
        raise TrajectoryRecordError(str(e)) from None
    _check_values(obj, trajectory)
    return trajectory


def _check_values(obj: dict, trajectory: Trajectory) -> None:
    """Raise TrajectoryRecordError (naming the field) for a non-finite weight, advantage or log-prob, or a positive
    log-prob, of `trajectory` as parsed from record `obj`."""
    if not math.isfinite(trajectory.weight):
        raise TrajectoryRecordError(f"must be a finite number, got {json.dumps(obj['weight'])}", field="weight")
    for key in _PER_TOKEN_VALUES:
        values = getattr(trajectory, key)
        if values is not None:
            _check_per_token(key, obj.get(key), values)


def _check_per_token(key: str, raw, values: np.ndarray) -> None:
    """Raise TrajectoryRecordError naming `key` and the first bad entry of `values` (parsed from the JSON value
    `raw`): not finite, or for a log-prob key positive."""
    log_probs = key in _LOG_PROBS
    bad = ~np.isfinite(values)
    if log_probs:
        bad |= values > 0
    if not bad.any():
        return
    if not isinstance(raw, list):
        raise TrajectoryRecordError(f"must be a finite number, got {json.dumps(raw)}", field=key)
    i = int(np.argmax(bad))
    rule = ("must hold log-probabilities (finite numbers <= 0; 0 for a token without one)" if log_probs else
            "must hold finite numbers")
    raise TrajectoryRecordError(f"{rule}, got {json.dumps(raw[i])} at index {i} (of {len(values)} tokens)", field=key)


def read_jsonl(path: str | Path) -> list[Trajectory]:
    """Read a TRAJ.jsonl file. Raises TrajectoryFileError naming the file and line on any problem."""
    path = Path(path)
    if not path.is_file():
        raise TrajectoryFileError(f"{path}: no such file")
    trajectories = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TrajectoryFileError(
                    f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); JSON "
                    "lines are UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrajectoryFileError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            try:
                trajectories.append(parse_record(obj))
            except TrajectoryRecordError as e:
                raise TrajectoryFileError(f"{where}: {e.describe()}") from None
    if not trajectories:
        raise TrajectoryFileError(f"{path}: the file holds no trajectories (it is empty)")
    return trajectories


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> None:
    """Write trajectories as TRAJ.jsonl (metadata that equals its default is omitted)."""
    with Path(path).open("w") as f:
        for t in trajectories:
            obj: dict = {"tokens": t.tokens.tolist()}
            if t.tree is not None:
                obj["tree"] = t.tree
            default_mask = np.ones(len(t), dtype=bool)
            default_mask[0] = False
            if not np.array_equal(t.loss_mask, default_mask):
                obj["loss_mask"] = t.loss_mask.astype(int).tolist()
            if np.any(t.advantage != 0):
                adv = t.advantage
                obj["advantage"] = float(adv[0]) if np.all(adv == adv[0]) else adv.tolist()
            if t.logprobs is not None:
                obj["logprobs"] = t.logprobs.tolist()
            if t.ref_logprobs is not None:
                obj["ref_logprobs"] = t.ref_logprobs.tolist()
            if t.weight != 1.0:
                obj["weight"] = t.weight
            if t.reward is not None:
                obj["reward"] = t.reward
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
