"""Faults while the RL job runs lose nothing (issue 18): a stop signal, a failing step, too many skipped steps, a
failing final checkpoint. Each prints one `error:` (or `stopped by`) line and no traceback, exits with the code the
README's "Failures and recovery" table documents, and leaves checkpoints that resume to the parameters of an
uninterrupted run (torch engine, one thread: bitwise repeatable, see tests/app/test_rl_job.py)."""

from __future__ import annotations

import signal
import time

import pytest

import app.rl_job
from app.__main__ import main
from app.checkpoint import Checkpointer
from tests.app.jobs import write_job
from tests.app.test_rl_job import app_process, models_equal


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
    prepare = app.rl_job.prepare_planned
    calls = []

    def crash_in_rl_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # 2 SFT steps, RL step 1, then RL step 2
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return prepare(*args, **kwargs)

    monkeypatch.setattr(app.rl_job, "prepare_planned", crash_in_rl_step_2)
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
    save = app.rl_job._Job.save

    def final_save_fails(job):
        if job.done.rl_done == job.config.train.steps:
            raise OSError(28, "No space left on device")
        save(job)

    monkeypatch.setattr(app.rl_job._Job, "save", final_save_fails)
    assert main([str(write_job(tmp_path)), "--checkpoint.interval=0"]) == 2
    out = capsys.readouterr().out
    assert "error: the final checkpoint failed: [Errno 28] No space left on device" in out
    assert "exported the policy" in out and (tmp_path / "hf" / "config.json").is_file()
