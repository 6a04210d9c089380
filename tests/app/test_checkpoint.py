"""Checkpoint folders: atomic writes (unfinished writes are invisible and removed on resume; a failing write removes
its folder and keeps the older ones), replacement, pruning, resume from the newest usable checkpoint (complete,
equal to its checksums, finite), a fresh run's set-aside of own folders only, refusal of pickles, earlier formats and
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

import app.checkpoint
import app.job
import app.rl_job
from app.__main__ import main
from app.checkpoint import PREVIOUS_RUN, Checkpointer, check_finite, rng_state, set_rng_state
from app.environments import make_environment
from app.errors import CheckpointError, CheckpointWriteError, NonFiniteError
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


def test_fresh_run_sets_aside_only_its_own_folders(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, trained(0), JOB)
    (tmp_path / "step-2.tmp").mkdir()
    (tmp_path / "step-00000003").mkdir()  # the earlier single-process format
    (tmp_path / "step-00000003" / "state.pt").write_bytes(b"old")
    for folder, file in (("mydata.tmp", "x.csv"), ("step-4", "notes.txt"), ("step-5.tmp", "mine.txt")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / file).write_text("the user's")
    (tmp_path / "step-6").write_text("a file, not a folder")
    assert checkpoints.set_aside() == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydata.tmp", PREVIOUS_RUN, "step-4", "step-5.tmp",
                                                          "step-6"]
    assert sorted(p.name for p in (tmp_path / PREVIOUS_RUN).iterdir()) == ["step-00000003", "step-1"]
    for step in (4, 5):
        with pytest.raises(CheckpointError, match=f"{tmp_path}/step-{step}(.tmp)? is in the way of the checkpoint of "
                                                  f"step {step} and holds other files than a checkpoint's"):
            checkpoints.save(step, trained(0), JOB)
    assert (tmp_path / "step-4" / "notes.txt").is_file() and (tmp_path / "step-5.tmp" / "mine.txt").is_file()


def test_a_fresh_run_keeps_the_earlier_checkpoints_until_it_has_one_of_its_own(tmp_path):
    earlier = Checkpointer(tmp_path)
    earlier.save(7, trained(7), {"run": "earlier"})
    fresh = Checkpointer(tmp_path)
    assert fresh.set_aside() == 1
    # Killed before its first checkpoint: a resume names where the earlier run's checkpoints are ...
    with pytest.raises(CheckpointError, match=f"the checkpoints of the run before the last fresh start are in "
                                              f"{tmp_path / PREVIOUS_RUN}: move its step-N folders back"):
        restore(Checkpointer(tmp_path), trained(0))
    # ... and a second fresh start with nothing new to move keeps them.
    assert Checkpointer(tmp_path).set_aside() == 0
    assert Checkpointer(tmp_path / PREVIOUS_RUN).load()["run"] == "earlier"
    fresh.save(1, trained(1), {"run": "fresh"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_failing_write_removes_its_folder_and_keeps_the_older_checkpoints(tmp_path, monkeypatch):
    checkpoints = Checkpointer(tmp_path, keep=2)
    checkpoints.save(1, trained(1), JOB)
    real_save = app.checkpoint.save_tensors

    def disk_full(tensors, folder):
        real_save(tensors, folder)
        (folder / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("unexpected pos 704 vs 598\nmore lines of the writer")

    monkeypatch.setattr(app.checkpoint, "save_tensors", disk_full)
    with pytest.raises(CheckpointWriteError, match=rf"writing {tmp_path}/step-2.tmp failed \(RuntimeError: unexpected "
                                                   rf"pos 704 vs 598\); removed it, {tmp_path} keeps step-1$"):
        checkpoints.save(2, trained(2), JOB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    monkeypatch.undo()
    # A failure writing job.json (rank 0's part) is handled the same way.
    monkeypatch.setattr(app.checkpoint.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(CheckpointWriteError, match=r"failed \(OSError: \[Errno 28\] No space left\)"):
        checkpoints.save(2, trained(2), JOB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_write_over_the_file_size_limit_removes_its_folder(tmp_path):
    """A real full disk: a child process whose file-size limit (ulimit -f, RLIMIT_FSIZE) is below a shard's size."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, sys
        from app.checkpoint import Checkpointer
        from app.errors import CheckpointWriteError
        from tests.app.test_checkpoint import trained
        import torch
        from torch import nn
        from parallel.checkpoint import TrainingState
        checkpoints = Checkpointer({str(tmp_path)!r})
        checkpoints.save(1, trained(1), {{}})
        torch.manual_seed(0)
        model = nn.Linear(256, 256)
        big = TrainingState(model, [torch.optim.AdamW(model.parameters())])
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        try:
            checkpoints.save(2, big, {{}})
        except CheckpointWriteError as e:
            print("refused:", e)
            sys.exit(0)
        sys.exit(1)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "refused: writing" in result.stdout and "removed it" in result.stdout, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_corrupt_shard_of_the_same_size_is_found_by_its_checksum(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=3)
    states = {step: trained(step) for step in (1, 2)}
    for step, state in states.items():
        checkpoints.save(step, state, {"step": step})
    shard = tmp_path / "step-2" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # a damaged block: 4 KB overwritten in place (the tensor data, not the header)
        f.seek(size // 2)
        f.write(os.urandom(min(4096, size // 2)))
    assert shard.stat().st_size == size
    into = trained(9)
    found = restore(checkpoints, into)
    assert found.path == tmp_path / "step-1" and same(into, states[1])
    assert found.notes == [f"skipped the unusable checkpoint step-2: {shard} does not match its checksum in job.json "
                           "(the file is corrupt)"]


def test_checkpoints_without_checksums_load_with_a_note(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    saved = trained(1)
    checkpoints.save(1, saved, JOB)
    job = json.loads((tmp_path / "step-1" / "job.json").read_text())
    assert sorted(job["sha256"]) == [".metadata", "__0_0.distcp"]
    del job["sha256"]
    (tmp_path / "step-1" / "job.json").write_text(json.dumps(job))
    into = trained(2)
    found = restore(checkpoints, into)
    assert same(into, saved)
    assert found.notes == [f"{tmp_path / 'step-1'} records no checksums (an earlier version wrote it): loaded "
                           "unverified"]


def test_a_non_finite_checkpoint_is_skipped_on_resume(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=3)
    good = trained(1)
    checkpoints.save(1, good, JOB)
    bad = trained(2)
    checkpoints.save(2, bad, JOB)
    # Written by hand (save refuses it): NaN in the weights, with matching checksums.
    with torch.no_grad():
        bad.model[0].weight[0, 0] = float("nan")
    app.checkpoint.save_tensors(bad.tensors(), tmp_path / "step-2.tmp")
    job = json.loads((tmp_path / "step-2" / "job.json").read_text())
    os.replace(tmp_path / "step-2.tmp" / "__0_0.distcp", tmp_path / "step-2" / "__0_0.distcp")
    os.replace(tmp_path / "step-2.tmp" / ".metadata", tmp_path / "step-2" / ".metadata")
    job["sha256"] = {name: app.checkpoint._sha256(tmp_path / "step-2" / name) for name in job["sha256"]}
    (tmp_path / "step-2" / "job.json").write_text(json.dumps(job))
    into = trained(9)
    found = restore(checkpoints, into)
    assert found.path == tmp_path / "step-1" and same(into, good)
    assert found.notes[-1] == ("skipped the unusable checkpoint step-2: model/0.weight has non-finite values (NaN or "
                               "inf)")


def test_a_non_finite_refusal_after_a_resume_names_the_checkpoint_resumed_from(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, trained(1), JOB)
    state = trained(2)
    restore(checkpoints, state)
    with torch.no_grad():
        state.model[0].weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=f"this run resumed from {tmp_path / 'step-1'} and has written no "
                                             "checkpoint since, so the values may come from that checkpoint: move "
                                             f"step-1 out of {tmp_path} to resume from the one before it"):
        checkpoints.save(2, state, JOB)


def test_an_interrupted_replacement_gets_its_earlier_folder_back(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    saved = trained(3)
    checkpoints.save(3, saved, JOB)
    # Killed between the two renames of replacing step-3: the complete earlier folder is step-3.old.tmp.
    os.replace(tmp_path / "step-3", tmp_path / "step-3.old.tmp")
    (tmp_path / "step-3.tmp").mkdir()
    into = trained(0)
    found = restore(checkpoints, into)
    assert found.path == tmp_path / "step-3" and same(into, saved)
    assert found.notes[0] == f"restored {tmp_path / 'step-3'} from an interrupted replacement"


def test_corrupt_newest_checkpoint_is_reported_and_the_newest_complete_one_used(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=4)
    states = {step: trained(step) for step in (1, 2, 3, 4)}
    for step, state in states.items():
        checkpoints.save(step, state, {"step": step})
    shard = tmp_path / "step-4" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 10)
    # Same length, scrambled bytes, in a checkpoint that records no checksums: only reading the shard finds it.
    shard = tmp_path / "step-3" / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    job = json.loads((tmp_path / "step-3" / "job.json").read_text())
    (tmp_path / "step-3" / "job.json").write_text(json.dumps({k: v for k, v in job.items() if k != "sha256"}))
    (tmp_path / "step-2" / "job.json").write_text('{"format": ')
    into = trained(9)
    found = restore(checkpoints, into)
    assert found.path == tmp_path / "step-1" and found.job == {"step": 1} and same(into, states[1])
    assert len(found.notes) == 3
    assert found.notes[0].startswith(f"skipped the unusable checkpoint step-4: shard file {tmp_path}/step-4/"
                                     "__0_0.distcp is truncated (")
    assert found.notes[1] == ("skipped the unusable checkpoint step-3: reading it failed (UnpicklingError: Weights "
                              "only load failed)")
    assert found.notes[2].startswith("skipped the unusable checkpoint step-2: job.json is unreadable (")

    (tmp_path / "step-1" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=f"`checkpoint.resume`: no checkpoint in {tmp_path} is usable "
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
    build = app.job.build_policy

    def diverged(*args):
        model, tokenizer = build(*args)
        with torch.no_grad():
            model.lm_head.weight[3, 5] = float("inf")
        return model, tokenizer

    monkeypatch.setattr(app.job, "build_policy", diverged)
    assert main([str(write_job(tmp_path))]) == 2
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("error:")] == [
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
