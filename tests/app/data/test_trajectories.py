"""Trajectory records (app.data.trajectories, planner/jsonl.py): path limits measured before a record is parsed, and
non-finite or positive values named by field, in the offline job's parser and in read_jsonl."""

from __future__ import annotations

import pytest

import app.data.trajectories
from app.data import path_limits
from app.data.trajectories import trajectory_parser
from planner.jsonl import TrajectoryFileError, read_jsonl
from rollout.envs.records import RecordError


def test_a_path_beyond_the_model_positions_is_refused_before_it_is_parsed(monkeypatch):
    """A 580,000-token path of a model with 4096 positions: refused by its length alone (nothing built from it)."""

    def parse_record(record):
        raise AssertionError("the record was parsed")

    monkeypatch.setattr(app.data.trajectories, "parse_record", parse_record)
    parse = trajectory_parser({}, vocab_size=128, limits=path_limits(4096, 65_536, "auto"))
    with pytest.raises(RecordError) as info:
        parse({"tokens": [5] * 580_000, "advantage": 1.0})
    assert info.value.describe() == "field 'tokens': path of 580,000 tokens exceeds the model's " \
                                    "max_position_embeddings 4096: shorten or drop it"


@pytest.mark.parametrize("mode, refused", [("duplicate", True), ("carry", False), ("auto", False)])
def test_only_duplicate_mode_limits_a_path_to_the_capacity(mode, refused):
    """Duplicate mode runs every path whole in one microbatch; carry and auto cut paths (and trees) anywhere."""
    parse = trajectory_parser({}, vocab_size=128, limits=path_limits(4096, 48, mode))
    record = {"tokens": [5] * 49}
    if not refused:
        assert len(parse(record)) == 49
        return
    with pytest.raises(RecordError, match=r"^path of 49 tokens exceeds planner.capacity = 48: duplicate mode") as info:
        parse(record)
    assert info.value.field == "tokens"


def test_read_jsonl_names_the_line_and_field_of_a_non_finite_value(tmp_path):
    path = tmp_path / "TRAJ.jsonl"
    path.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [1, 2, 3], "ref_logprobs": [0, -1.5, NaN]}\n')
    with pytest.raises(TrajectoryFileError) as info:
        read_jsonl(path)
    assert str(info.value) == f"{path}:2: field 'ref_logprobs': must hold log-probabilities (finite numbers <= 0; 0 " \
                              "for a token without one), got NaN at index 2 (of 3 tokens)"
