"""Small RL job configs for the app tests: a narrow tiny-qwen3-next, a few short rollout trees per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

import app.data.feed
from app.__main__ import main

#: Output folders inside the job's folder, a checkpoint every step, no progress bars.
OUTPUTS = """
[checkpoint]
dir = "ck"
interval = 1
keep = 10
export_dir = "hf"

[metrics]
log_dir = "tb"
progress = false
"""

#: Torch engine (seeded, reproducible) and the coin environment: nonzero advantages without training.
TORCH_JOB = """
[model]
vocab_size = 128
hidden_size = 64

[rollout]
engine = "torch"
seed = 7
env = "tests.app.coin_env:CoinEnv"
tasks_per_step = 3
fan_out = 2
max_turns = 2
max_new_tokens = 5
# Paths are at most 20 tokens (5-token prompt, two 5-token turns, a 5-token observation in between); a path fits
# max_model_len + max_env_tokens <= capacity, as the config check requires.
max_model_len = 40
max_env_tokens = 8

[planner]
# Several microbatches per step: gradients accumulate across them.
capacity = 48

[train]
threads = 1
sft_steps = 2
sft_tasks_per_step = 3
steps = 4
lr = 1e-3
warmup_steps = 2

""" + OUTPUTS + "tree_picture_interval = 2\n"


def write_job(folder: Path, text: str = TORCH_JOB, extra: str = "") -> Path:
    path = folder / "job.toml"
    path.write_text(text + extra)
    return path


def recording_batches(monkeypatch: pytest.MonkeyPatch, value: Callable[[Any], Any] = lambda record: record):
    """Patch the feeds (app.data.feed.RecordFeed, tasks and trajectories alike) to record every step's records as
    the job received them; returns (run, runs): run(*argv) runs `python -m app` in this process, runs[i] is run
    i's {step: [value(record), ...]}."""
    runs: list[dict[int, list]] = []
    take = app.data.feed.RecordFeed.next_batch

    def recording(self, count, step):
        batch = take(self, count, step)
        runs[-1][step] = [value(record) for record in batch]
        return batch

    monkeypatch.setattr(app.data.feed.RecordFeed, "next_batch", recording)

    def run(*args: str) -> int:
        runs.append({})
        return main(list(args))

    return run, runs
