"""The errors a job reports: one `error:` line each, no traceback, and the exit code that README's "Failures and
recovery" table documents.

    JobError                       the base: `exit_code`, `what` (the error line's prefix), `checkpoint`
      ConfigError              2   a setting, config file or input file that cannot work (before any work, mostly)
      DataError                2   a bad task or trajectory record (app.data), with its file, line and field
      CheckpointError          2   a checkpoint that cannot be used (resume)
        CheckpointWriteError   2   a checkpoint that could not be written (the older ones are kept)
      NonFiniteError           2   weights with NaN or inf, refused by a checkpoint or the export
      ExportError              2   the Hugging Face export could not be written (the previous one is kept)
      InvalidEnvironmentOutput 2   the environment returned what a rollout tree cannot hold
      EngineFailure            3   the rollout engine failed
      TooManySkipped           4   `train.max_skipped_steps` optimizer steps in a row were skipped

Errors of the layers below (rollout.EngineError, rollout.EnvironmentOutputError, models.hf_io.HFCheckpointError,
planner.jsonl.TrajectoryFileError) are theirs; the job turns them into these where it calls those layers. A stop
signal is not an error: app.stop_signal (exit 128 + the signal's number).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["JobError", "ConfigError", "DataError", "CheckpointError", "CheckpointWriteError", "NonFiniteError",
           "ExportError", "InvalidEnvironmentOutput", "EngineFailure", "TooManySkipped"]


class JobError(Exception):
    """An error the job reports as one line and an exit code."""

    exit_code: ClassVar[int] = 1
    what: ClassVar[str] = ""
    """What the error line says failed, before "at step N" (empty: the message says it); "{record}" stands for the
    job's kind of record ("task record", "trajectory record")."""
    checkpoint: ClassVar[bool] = True
    """Whether the job checkpoints its last consistent state before it exits."""
    after_step: ClassVar[bool] = False
    """Raised after a step finished (the error line names that step), not during the next one."""
    names_step: ClassVar[bool] = False
    """The message names its step itself (the error line adds no "at step N")."""


class ConfigError(JobError):
    """A setting, a config file or an input file that cannot work; the message names the key, file or line and the
    fix."""

    exit_code = 2


class DataError(JobError):
    """A bad input record (a task or trajectory record): the message names its file, line and field."""

    exit_code = 2
    what = "bad {record}"


class CheckpointError(JobError):
    """A checkpoint that cannot be used; the message names the folder and what to do."""

    exit_code = 2


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; its unfinished folder was removed and the older checkpoints are kept."""

    checkpoint = False


class NonFiniteError(JobError):
    """Weights with NaN or inf values, refused by a checkpoint or an export (nothing of them is written)."""

    exit_code = 2
    checkpoint = False
    names_step = True


class ExportError(JobError):
    """Writing the export failed; the previous export (if any) is whole."""

    exit_code = 2


class InvalidEnvironmentOutput(JobError):
    """The environment returned output a rollout tree cannot hold; the message names the tree and the turn."""

    exit_code = 2
    what = "invalid environment output"


class EngineFailure(JobError):
    """The rollout engine failed (to start, generate or take new weights)."""

    exit_code = 3
    what = "rollout engine failed"


class TooManySkipped(JobError):
    """`train.max_skipped_steps` optimizer steps in a row were skipped for a non-finite loss or gradient norm."""

    exit_code = 4
    after_step = True
