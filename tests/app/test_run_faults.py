"""Faults while the RL job runs lose nothing: a stop signal (a second one wherever it lands), a failing step, too
many skipped steps, a failing or full-disk checkpoint, a failing export, a fresh run killed before its first
checkpoint. Each prints one `error:` (or `stopped by`) line and no traceback, exits with the code the README's
"Failures and recovery" table documents, and leaves checkpoints (or an export) that hold the parameters of an
uninterrupted run (torch engine, one thread: bitwise repeatable, see tests/app/test_rl_job.py)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest
from safetensors import SafetensorError

import app.checkpoint
import app.job
import app.rl_job
import models.hf_io
from app.__main__ import main
from app.checkpoint import PREVIOUS_RUN, Checkpointer
from models.hf_io import load_hf
from rollout import EngineError
from tests.app.jobs import write_job
from tests.app.test_rl_job import ROOT, app_process, models_equal


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("uninterrupted")
    assert main([str(write_job(folder))]) == 0
    return Checkpointer(folder / "ck").load()


def resume_equals(config, checkpoints: Checkpointer, uninterrupted: dict) -> None:
    resumed = app_process(config, "--resume")
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    final = checkpoints.load()
    assert final["progress"] == uninterrupted["progress"] == {"sft_done": 2, "rl_done": 4}
    assert models_equal(final["model"], uninterrupted["model"])


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_finishes_the_step_saves_and_resumes_exactly(tmp_path, uninterrupted, signum, code):
    config = write_job(tmp_path)
    checkpoints = Checkpointer(tmp_path / "ck")
    process = app_process(config)
    deadline = time.monotonic() + 120
    while 3 not in checkpoints.steps():  # after SFT and RL step 1
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "the run never reached its 3rd checkpoint"
        time.sleep(0.02)
    process.send_signal(signum)
    lines = []
    output = "".join(lines) + process.stdout.read()
    assert process.wait() == code, output
    assert "Traceback" not in output
    (stopped,) = [line for line in output.splitlines() if line.startswith("stopped by")]
    assert stopped.startswith(f"stopped by {signal.Signals(signum).name} after step ")
    assert "; continue with --resume" in stopped
    assert max(checkpoints.steps()) < 6, "the run finished before the signal took effect"
    resume_equals(config, checkpoints, uninterrupted)


def test_a_failing_step_keeps_the_last_consistent_state(tmp_path, capsys, monkeypatch, uninterrupted):
    prepare = app.job.prepare_step
    calls = []

    def crash_in_rl_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # 2 SFT steps, RL step 1, then RL step 2
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return prepare(*args, **kwargs)

    monkeypatch.setattr(app.job, "prepare_step", crash_in_rl_step_2)
    config = write_job(tmp_path)
    assert main([str(config), "--checkpoint.interval=0"]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out
    (error,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert error.startswith("error: step 4 failed: RuntimeError: CUDA error: an illegal memory access")
    where = error.split("(traceback in ")[1].rstrip(")")
    assert "RuntimeError" in open(where).read()
    checkpoints = Checkpointer(tmp_path / "ck")
    assert checkpoints.steps() == [3] and checkpoints.load()["progress"] == {"sft_done": 2, "rl_done": 1}
    monkeypatch.undo()
    resume_equals(config, checkpoints, uninterrupted)


def test_too_many_skipped_steps_stop_with_the_last_finite_state(tmp_path, capsys, monkeypatch):
    assign = app.rl_job.assign_advantages

    def nan_advantages(trajectories, *args):
        assign(trajectories, *args)
        trajectories[0].advantage[:] = float("nan")

    monkeypatch.setattr(app.rl_job, "assign_advantages", nan_advantages)
    assert main([str(write_job(tmp_path)), "--train.max_skipped_steps=2"]) == 4
    out = capsys.readouterr().out
    assert "Traceback" not in out
    (error,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert "2 optimizer steps in a row were skipped" in error and "`train.max_skipped_steps` = 2" in error
    checkpoints = Checkpointer(tmp_path / "ck")
    last = checkpoints.load()
    assert last["progress"] == {"sft_done": 2, "rl_done": 2}
    # Skipped steps change nothing: the last checkpoint holds the weights after SFT.
    assert models_equal(last["model"], checkpoints.load(checkpoints.path(2))["model"])
    assert not (tmp_path / "hf" / "config.json").exists(), "nothing is exported after a stop"


def test_the_export_runs_even_when_the_final_checkpoint_fails(tmp_path, capsys, monkeypatch):
    save = app.job.Job.save

    def final_save_fails(job):
        if job.done.rl_done == job.config.train.steps:
            raise OSError(28, "No space left on device")
        save(job)

    monkeypatch.setattr(app.job.Job, "save", final_save_fails)
    assert main([str(write_job(tmp_path)), "--checkpoint.interval=0"]) == 2
    out = capsys.readouterr().out
    assert "error: the final checkpoint failed: [Errno 28] No space left on device" in out
    assert "exported the policy" in out and (tmp_path / "hf" / "config.json").is_file()


def exported_equals(folder, model: dict) -> bool:
    """The HF export in `folder` holds the parameters `model` (a checkpoint's "model" group)."""
    return models_equal(dict(load_hf(folder).state_dict()), model)


def one_error(out: str) -> str:
    assert "Traceback" not in out, out
    (error,) = [line for line in out.splitlines() if line.startswith("error:")]
    return error


def test_a_full_disk_at_the_final_checkpoint_still_exports_what_was_trained(tmp_path, uninterrupted):
    """A real write limit (RLIMIT_FSIZE, `ulimit -f`): the 13 MB checkpoint shard fails, the 4 MB export does not."""
    limit = 8 * 2**20
    process = subprocess.run(
        [sys.executable, "-m", "app", str(write_job(tmp_path)), "--checkpoint.interval=0"], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    out = process.stdout + process.stderr
    assert process.returncode == 2, out
    error = one_error(out)
    assert error.startswith(f"error: the final checkpoint failed: writing {tmp_path}/ck/step-6.tmp failed ("), error
    assert error.endswith(f"; removed it, {tmp_path}/ck keeps no checkpoint"), error
    assert "exported the policy" in out
    assert list((tmp_path / "ck").iterdir()) == []
    assert exported_equals(tmp_path / "hf", uninterrupted["model"])


def test_a_failing_periodic_checkpoint_keeps_the_older_ones_and_exports(tmp_path, capsys, monkeypatch, uninterrupted):
    write = app.checkpoint.save_tensors
    calls = []

    def fails_at_step_4(tensors, folder):
        calls.append(folder)
        write(tensors, folder)
        if len(calls) == 4:
            (folder / "__0_0.distcp").write_bytes(b"partial")
            raise RuntimeError("unexpected pos 704 vs 598")

    monkeypatch.setattr(app.checkpoint, "save_tensors", fails_at_step_4)
    assert main([str(write_job(tmp_path))]) == 2
    out = capsys.readouterr().out
    ck = tmp_path / "ck"
    assert one_error(out) == (f"error: the checkpoint of step 4 failed: writing {ck}/step-4.tmp failed (RuntimeError: "
                              f"unexpected pos 704 vs 598); removed it, {ck} keeps step-1, step-2, step-3")
    assert "exported the policy" in out
    assert Checkpointer(ck).steps() == [1, 2, 3] and not (ck / "step-4.tmp").exists()
    assert not exported_equals(tmp_path / "hf", Checkpointer(ck).load()["model"]), "step 4 was trained and exported"


def test_a_failing_export_leaves_the_previous_export_whole(tmp_path, capsys, monkeypatch):
    assert main([str(write_job(tmp_path))]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    capsys.readouterr()

    def disk_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(models.hf_io, "save_file", disk_full)
    # A narrower model: its config.json beside the previous safetensors would no longer load.
    assert main([str(write_job(tmp_path)), "--model.hidden_size=32"]) == 2
    hf = tmp_path / "hf"
    assert one_error(capsys.readouterr().out) == (
        f"error: the export failed: writing {tmp_path}/.hf.tmp failed (SafetensorError: Error while serializing: "
        f"IoError(Os {{ code: 28, kind: StorageFull }})); removed it, {hf} keeps the previous export")
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".hf")) == []
    assert Checkpointer(tmp_path / "ck").steps()[-1] == 6, "the final checkpoint does not depend on the export"


def test_a_fresh_run_killed_before_its_first_checkpoint_keeps_the_earlier_run(tmp_path, capsys, monkeypatch,
                                                                              uninterrupted):
    config = write_job(tmp_path)
    assert main([str(config)]) == 0

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(app.job, "prepare_step", crash)
    assert main([str(config)]) == 1
    out = capsys.readouterr().out
    assert "nothing was trained: no checkpoint was written" in out
    ck = tmp_path / "ck"
    assert Checkpointer(ck).steps() == []
    earlier = Checkpointer(ck / PREVIOUS_RUN)
    assert earlier.steps() == [1, 2, 3, 4, 5, 6]
    assert models_equal(earlier.load()["model"], uninterrupted["model"])
    assert main([str(config), "--resume"]) == 2
    assert f"the checkpoints of the run before the last fresh start are in {ck / PREVIOUS_RUN}" in \
        capsys.readouterr().err


def test_a_second_signal_inside_code_that_catches_exception_still_abandons_the_step(tmp_path, capsys, monkeypatch):
    """The second SIGTERM lands in an engine start-up that wraps every Exception as an engine failure (vLLM's does),
    inside a subprocess call (torch's CPU-feature probe runs one)."""
    build = app.rl_job.build_engine

    def start_up(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            subprocess.run(["sleep", "5"], check=False)
        except Exception as e:
            raise EngineError(f"engine start-up failed: {e}") from e
        return build(*args, **kwargs)

    monkeypatch.setattr(app.rl_job, "build_engine", start_up)
    started = time.monotonic()
    assert main([str(write_job(tmp_path))]) == 143
    assert time.monotonic() - started < 60
    out = capsys.readouterr().out
    assert one_error(out) == "error: SIGTERM received twice: the step was abandoned (step 3)"
    assert f"the trainer state is in {tmp_path / 'ck' / 'step-2'}; continue with --resume" in out
