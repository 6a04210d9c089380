"""Checkpoint folders: atomic writes (unfinished writes are invisible and removed on resume), replacement, pruning,
resume from the newest complete checkpoint, removal of own folders only, refusal of pickles, earlier formats and
non-finite weights, JSON RNG states; and the tree picture drawn for TensorBoard."""

from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import app.rl_job
from app.__main__ import main
from app.checkpoint import (
    Checkpointer,
    CheckpointError,
    NonFiniteError,
    check_finite,
    rng_state,
    set_rng_state,
)
from app.environments import make_environment
from app.tree_picture import BOX_H, GAP_Y, render_tree
from parallel.checkpoint import TrainingState
from rollout import build_char_tokenizer, demonstration_tree
from tests.app.jobs import write_job

JOB = {"progress": {"sft_done": 1, "rl_done": 0}, "run_name": "r"}


def trained(seed: int, steps: int = 1) -> TrainingState:
    """A small model and its AdamW state after `steps` steps."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 5)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return TrainingState(model, [optimizer])


def same(a: TrainingState, b: TrainingState) -> bool:
    x, y = a.tensors(), b.tensors()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def restore(checkpoints: Checkpointer, into: TrainingState):
    return checkpoints.restore(lambda groups: into)


class Payload:
    """Unpickling it creates the file `path`: what a malicious checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_save_restore_round_trip_and_unfinished_writes(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=2)
    saved = trained(0)
    checkpoints.save(1, saved, JOB)
    assert sorted(p.name for p in (tmp_path / "step-1").iterdir()) == [".metadata", "__0_0.distcp", "job.json"]
    # A run killed while writing step 2 leaves only its temporary folder behind.
    (tmp_path / "step-2.tmp").mkdir()
    (tmp_path / "step-2.tmp" / "__0_0.distcp").write_bytes(b"truncated")
    assert checkpoints.steps() == [1] and checkpoints.latest() == tmp_path / "step-1"
    into = trained(1, steps=2)
    assert not same(into, saved)
    found = restore(checkpoints, into)
    assert found.job == JOB and found.path == tmp_path / "step-1" and same(into, saved)
    assert found.notes == [f"removed the unfinished checkpoint write {tmp_path / 'step-2.tmp'}"]
    assert not (tmp_path / "step-2.tmp").exists()


def test_replace_and_prune(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        checkpoints.save(step, trained(step), {"step": step})
    checkpoints.save(3, trained(33), {"step": 33})
    assert checkpoints.steps() == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    state = checkpoints.load()
    assert state["step"] == 33 and state["reference"] is None
    assert torch.equal(state["model"]["0.weight"], trained(33).model[0].weight)


def test_fresh_run_removes_only_its_own_folders(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, trained(0), JOB)
    (tmp_path / "step-2.tmp").mkdir()
    (tmp_path / "step-00000003").mkdir()  # the earlier single-process format
    (tmp_path / "step-00000003" / "state.pt").write_bytes(b"old")
    for folder, file in (("mydata.tmp", "x.csv"), ("step-4", "notes.txt"), ("step-5.tmp", "mine.txt")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / file).write_text("the user's")
    (tmp_path / "step-6").write_text("a file, not a folder")
    assert checkpoints.remove_all() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydata.tmp", "step-4", "step-5.tmp", "step-6"]
    for step in (4, 5):
        with pytest.raises(CheckpointError, match=f"{tmp_path}/step-{step}(.tmp)? is in the way of the checkpoint of "
                                                  f"step {step} and holds other files than a checkpoint's"):
            checkpoints.save(step, trained(0), JOB)
    assert (tmp_path / "step-4" / "notes.txt").is_file() and (tmp_path / "step-5.tmp" / "mine.txt").is_file()


def test_corrupt_newest_checkpoint_is_reported_and_the_newest_complete_one_used(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=4)
    states = {step: trained(step) for step in (1, 2, 3, 4)}
    for step, state in states.items():
        checkpoints.save(step, state, {"step": step})
    shard = tmp_path / "step-4" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 10)
    # Same length, scrambled bytes: only reading the shard finds it.
    shard = tmp_path / "step-3" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    (tmp_path / "step-2" / "job.json").write_text('{"format": ')
    into = trained(9)
    found = restore(checkpoints, into)
    assert found.path == tmp_path / "step-1" and found.job == {"step": 1} and same(into, states[1])
    assert len(found.notes) == 3
    assert found.notes[0].startswith(f"skipped the incomplete checkpoint step-4: shard file {tmp_path}/step-4/"
                                     "__0_0.distcp is truncated (")
    assert found.notes[1] == ("skipped the incomplete checkpoint step-3: reading it failed (UnpicklingError: Weights "
                              "only load failed)")
    assert found.notes[2].startswith("skipped the incomplete checkpoint step-2: job.json is unreadable (")

    (tmp_path / "step-1" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=f"`checkpoint.resume`: no checkpoint in {tmp_path} is complete "
                                              r"\(step-4: shard file .* is truncated .*; step-1: .*\.metadata is "
                                              r"missing\); run without --resume to start fresh"):
        restore(checkpoints, into)


def test_no_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path / 'none'}; run without --resume"):
        restore(Checkpointer(tmp_path / "none"), trained(0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_carrying_a_pickle_payload_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    checkpoints = Checkpointer(tmp_path / "ck")
    checkpoints.save(1, trained(0), JOB)
    (tmp_path / "ck" / "step-1" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"refused .*step-1: .*\.metadata: it refers to `posix.system`, which "
                                              "DCP metadata never holds"):
        restore(checkpoints, trained(0))
    # A non-tensor entry, which DCP itself would unpickle with torch.load(weights_only=False).
    folder = tmp_path / "ck" / "step-2"
    dcp.save({"model/0.weight": torch.ones(3, 5), "payload": Payload(marker)}, checkpoint_id=str(folder), no_dist=True)
    (folder / "job.json").write_text(json.dumps({"format": "arbor-checkpoint-1", "step": 2, "job": JOB}))
    with pytest.raises(CheckpointError, match="entry 'payload' is not a tensor"):
        restore(checkpoints, trained(0))
    assert not marker.exists()


def test_earlier_formats_are_named_with_what_to_do(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "step-00000012").mkdir()
    (tmp_path / "step-00000012" / "state.pt").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"step-00000012 is a checkpoint of Arbor's earlier single-process "
                                              r"format \(state.pt, a pickle, which this version never loads\): finish "
                                              "that run with the version that wrote it, or run without --resume"):
        restore(Checkpointer(tmp_path), trained(0))
    assert not marker.exists()
    (tmp_path / "step-13").mkdir()
    (tmp_path / "step-13" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="step-13 is a checkpoint of Arbor's earlier distributed format"):
        restore(Checkpointer(tmp_path), trained(0))


def test_checkpoint_of_another_model_is_an_error(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, trained(0), JOB)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    other = TrainingState(model, [torch.optim.AdamW(model.parameters())])
    with pytest.raises(CheckpointError, match=r"tensor 'model/0.weight' has shape \(3, 5\) there, \(4, 5\) here: "
                                              "the checkpoint was written for another model"):
        restore(checkpoints, other)


def test_non_finite_weights_are_refused(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, trained(0), JOB)
    state = trained(0)
    with torch.no_grad():
        state.model[2].bias[1] = float("nan")
    with pytest.raises(NonFiniteError, match=f"checkpoint of step 2 refused: model/2.bias has non-finite values "
                                             rf"\(NaN or inf\); {tmp_path} keeps the earlier checkpoints"):
        checkpoints.save(2, state, JOB)
    with pytest.raises(NonFiniteError, match="checkpoint of step 1 refused"):
        checkpoints.save(1, state, JOB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    assert torch.equal(checkpoints.load()["model"]["2.bias"], trained(0).model[2].bias)
    with pytest.raises(NonFiniteError, match=r"the export refused: 2.bias has non-finite values \(NaN or inf\), "
                                             "nothing was written"):
        check_finite(state.model.state_dict(), "the export")
    check_finite(trained(0).model.state_dict(), "the export")


def test_job_stops_with_one_error_line_instead_of_checkpointing_non_finite_weights(tmp_path, capsys, monkeypatch):
    build = app.rl_job.build_policy

    def diverged(*args):
        model, tokenizer = build(*args)
        with torch.no_grad():
            model.lm_head.weight[3, 5] = float("inf")
        return model, tokenizer

    monkeypatch.setattr(app.rl_job, "build_policy", diverged)
    assert main([str(write_job(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"error: checkpoint of step 1 refused: model/lm_head.weight has non-finite values (NaN or inf); "
        f"{tmp_path / 'ck'} keeps the earlier checkpoints (resume from one with a smaller `train.lr` / "
        "`train.sft_lr`)"]
    assert "Traceback" not in captured.out and "SFT step 1: non-finite loss" in captured.out
    assert not list((tmp_path / "ck").glob("step-*"))


def test_job_names_a_checkpoint_of_the_earlier_format(tmp_path, capsys):
    (tmp_path / "ck" / "step-00000004").mkdir(parents=True)
    (tmp_path / "ck" / "step-00000004" / "state.pt").write_bytes(b"old")
    assert main([str(write_job(tmp_path)), "--resume"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: `checkpoint.resume`: {tmp_path / 'ck' / 'step-00000004'} is "
                                               "a checkpoint of Arbor's earlier single-process format")


def test_rng_round_trip_through_json():
    state = json.loads(json.dumps(rng_state()))
    draws = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1))
    set_rng_state(state)
    assert draws == (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(1))


def test_tree_picture_has_one_row_per_path():
    tokenizer = build_char_tokenizer()
    env = make_environment("calculator", {"num_operations": 2})
    tree = demonstration_tree(env, env.sample_tasks(1, random.Random(0))[0], tokenizer, tree_id="demo")
    image = render_tree(tree, tokenizer)
    paths = len(tree.leaves())
    assert paths == 2
    assert image.height >= paths * (BOX_H + GAP_Y)
    pixels = np.asarray(image)
    # Both demonstrations are rewarded: their answer boxes carry the green outline.
    assert (pixels == (40, 150, 60)).all(-1).sum() > 100
