import re

import pytest

from app.__main__ import main
from app.config import ConfigError, JobConfig
from app.config_loader import load_config, parse_overrides, to_toml


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_and_file_values(tmp_path):
    config = load_config(JobConfig, write(tmp_path, "[planner]\ncapacity = 128\n[parallel]\ndp_shard = 2\n"))
    assert config.planner.capacity == 128 and config.parallel.dp_shard == 2
    assert config.planner.chunk_size is None and config.job.kind == "rl"


def test_overrides_win_and_parse_toml_values(tmp_path):
    config = load_config(
        JobConfig, write(tmp_path, "[planner]\ncapacity = 128\n"), ["--planner.capacity=256", "--model.dtype=bfloat16"]
    )
    assert config.planner.capacity == 256 and config.model.dtype == "bfloat16"
    assert parse_overrides(["--a.b=1.5", "--a.c=true", "--a.d=hello"]) == {"a": {"b": 1.5, "c": True, "d": "hello"}}


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("[planner]\ncapacty = 1\n", [], r"unknown key `planner.capacty` \(did you mean 'capacity'\?\)"),
        ("[planer]\ncapacity = 1\n", [], r"unknown key `planer` \(did you mean 'planner'\?\)"),
        ("[planner]\ncapacity = 'big'\n", [], r"`planner.capacity` must be an integer"),
        ("[model]\ndtype = 'fp8'\n", [], r"`model.dtype` must be one of"),
        ("[planner]\ncapacity = 0\n", [], r"`planner.capacity` must be >= 1"),
        ("", ["--planner.chunk_size=x"], r"`planner.chunk_size` must be an integer"),
        ("", ["--planner=3"], r"--section.key=value"),
        ("[rollout]\ntrajectories = 'missing.jsonl'\n", [], r"`rollout.trajectories`: file .*missing.jsonl does not exist"),
        ("[planner\n", [], r"invalid TOML"),
        ("[rollout]\nfan_out = 0\n", [], r"\[rollout\] `fan_out` must be a positive integer"),
        ("[rollout.vllm]\nenforce_eagr = true\n", [],
         r"unknown key `rollout.vllm.enforce_eagr` \(did you mean 'enforce_eager'\?\)"),
        ("[rl]\nclip_low = 1.5\n", [], r"\[rl\] `clip_low` must lie in \[0, 1\)"),
        ("", ["--rl.epochs=0"], r"`rl.epochs` must be >= 1"),
        ("[job]\nkind = 'sft'\n", [], r"`job.kind` must be one of 'rl', 'plan'"),
        ("[parallel]\ntp = 0\n", [], r"`parallel.tp` must be >= 1"),
        ("", ["--train.steps=-1"], r"`train.steps` must be >= 0"),
    ],
)
def test_errors_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(JobConfig, write(tmp_path, text), overrides)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(JobConfig, tmp_path / "nope.toml")


def test_print_config_round_trips(tmp_path, capsys):
    overrides = ["--parallel.dp_shard=4", "--rollout.vllm.enforce_eager=true",
                 "--rollout.env_options={max_operand = 5}"]
    assert main([str(write(tmp_path, "[planner]\ncapacity = 77\n")), "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "[rollout.vllm]" in printed
    again = load_config(JobConfig, write(tmp_path, printed))
    assert again.planner.capacity == 77 and again.parallel.dp_shard == 4
    assert again.rollout.vllm.enforce_eager and again.rollout.env_options == {"max_operand": 5}


def test_bad_config_exits_2_with_one_line(tmp_path, capsys):
    assert main([str(write(tmp_path, "[train]\nsede = 1\n"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.sede" in err[0] and "seed" in err[0]


def test_plan_job_reports_packing(capsys):
    assert main(["configs/demo.toml", "--job.kind=plan"]) == 0
    out = capsys.readouterr().out
    assert "compression" in out and "compact tokens" in out


def test_to_toml_shows_unset_values():
    assert "# hf_path = (unset)" in to_toml(JobConfig())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--rollout.env=maze"],
         r"`rollout.env` = 'maze' is neither a built-in environment \(calculator, chat_calculator, answer\)"),
        (["--rollout.env=tests.app.nowhere:Env"], r"cannot import module 'tests.app.nowhere'"),
        (["--rollout.env=tests.app.coin_env:Coin"], r"module 'tests.app.coin_env' has no attribute 'Coin'"),
        (["--rollout.env_options={size = 3}"], r"`rollout.env_options` \{'size': 3\} for environment 'calculator'"),
        (["--model.preset=tiny"], r"`model.preset` must be one of"),
        (["--model.vocab_size=50"], r"`model.vocab_size`: `vocab_size` must be at least 106"),
        (["--planner.chunk_size=32"], r"`planner.chunk_size` = 32 differs from the model's linear-attention chunk"),
        (["--data.tasks=nowhere/*.jsonl"], r"`data.tasks`: '.*/nowhere/\*.jsonl' matches no file"),
        (["--data.epochs=0"], r"`data.epochs` must be >= 1 or unset, got 0"),
        (["--rollout.env=answer"], r"`rollout.env` = 'answer' speaks chat messages, but the tokenizer .* has no chat "
                                   r"template; chat environments need one \(model.hf_path"),
    ],
)
def test_job_config_errors_exit_2(tmp_path, capsys, overrides, message):
    path = write(tmp_path, "[model]\nvocab_size = 128\nhidden_size = 64\n[train]\nsteps = 0\n")
    assert main([str(path), *overrides]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_resume_flag_sets_checkpoint_resume(tmp_path, capsys):
    assert main([str(write(tmp_path, "")), "--resume", "--print-config"]) == 0
    assert "resume = true" in capsys.readouterr().out
