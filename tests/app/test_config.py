import re

import pytest

from app.__main__ import main
from app.config import JobConfig
from app.config_loader import load_config, parse_overrides, to_toml
from app.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_and_file_values(tmp_path):
    config = load_config(JobConfig, write(tmp_path, "[planner]\ncapacity = 4096\n[parallel]\ndp_shard = 2\n"))
    assert config.planner.capacity == 4096 and config.parallel.dp_shard == 2
    assert config.job.kind == "rl"


def test_overrides_win_and_parse_toml_values(tmp_path):
    config = load_config(
        JobConfig, write(tmp_path, "[planner]\ncapacity = 4096\n"),
        ["--planner.capacity=8192", "--model.dtype=bfloat16"],
    )
    assert config.planner.capacity == 8192 and config.model.dtype == "bfloat16"
    assert parse_overrides(["--a.b=1.5", "--a.c=true", "--a.d=hello"]) == {"a": {"b": 1.5, "c": True, "d": "hello"}}


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("[planner]\ncapacty = 1\n", [], r"unknown key `planner.capacty` \(did you mean 'capacity'\?\)"),
        ("[planer]\ncapacity = 1\n", [], r"unknown key `planer` \(did you mean 'planner'\?\)"),
        ("[planner]\ncapacity = 'big'\n", [], r"`planner.capacity` must be an integer"),
        ("[model]\ndtype = 'fp8'\n", [], r"`model.dtype` must be one of"),
        ("[planner]\ncapacity = 0\n", [], r"`planner.capacity` must be >= 1"),
        ("", ["--planner.carry_resident=-1"], r"`planner.carry_resident` must be >= 0"),
        ("", ["--planner.capacity=x"], r"`planner.capacity` must be an integer"),
        ("", ["--planner.cost.tree_per_view_row=-1e-6"], r"`planner.cost.tree_per_view_row` must be >= 0 seconds"),
        ("[planner.cost]\nexpansion_per_tokn = 1e-5\n", [],
         r"unknown key `planner.cost.expansion_per_tokn` \(did you mean 'expansion_per_token'\?\)"),
        ("", ["--planner=3"], r"--section.key=value"),
        ("[job]\nkind = 'plan'\n[rollout]\ntrajectories = 'missing.jsonl'\n", [],
         r"`rollout.trajectories`: file .*missing.jsonl does not exist"),
        ("[planner\n", [], r"invalid TOML"),
        ("[rollout]\nfan_out = 0\n", [], r"\[rollout\] `fan_out` must be a positive integer"),
        ("[rollout.vllm]\nenforce_eagr = true\n", [],
         r"unknown key `rollout.vllm.enforce_eagr` \(did you mean 'enforce_eager'\?\)"),
        ("[rl]\nclip_low = 1.5\n", [], r"\[rl\] `clip_low` must lie in \[0, 1\)"),
        ("", ["--rl.epochs=0"], r"`rl.epochs` must be >= 1"),
        ("[job]\nkind = 'sft'\n", [], r"`job.kind` must be one of 'rl', 'plan'"),
        ("[parallel]\ntp = 0\n", [], r"`parallel.tp` must be >= 1"),
        ("", ["--train.steps=-1"], r"`train.steps` must be >= 0"),
        ("", ["--checkpoint.export_dir="], r"`checkpoint.export_dir` is an empty path: give a path, or none to unset"),
        ("[metrics]\nlog_dir = ''\n", [], r"`metrics.log_dir` is an empty path"),
        ("", ["--checkpoint.dir=none"], r"`checkpoint.dir` cannot be unset: give it a value"),
        ("", ["--train.lr=none"], r"`train.lr` must be a number, got 'none'"),
        ("", ["--rollout.vllm.gpu_memory_utilization=0"],
         r"`rollout.vllm.gpu_memory_utilization` must lie in \(0, 1\]"),
        ("", ["--rollout.max_model_len=0"], r"`rollout.max_model_len` must be >= 1"),
        ("", ["--train.weight_decay=-0.1"], r"`train.weight_decay` must be >= 0"),
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
    assert main([str(write(tmp_path, "[planner]\ncapacity = 7777\n")), "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "[rollout.vllm]" in printed
    again = load_config(JobConfig, write(tmp_path, printed))
    assert again.planner.capacity == 7777 and again.parallel.dp_shard == 4
    assert again.rollout.vllm.enforce_eager and again.rollout.env_options == {"max_operand": 5}


def test_bad_config_exits_2_with_one_line(tmp_path, capsys):
    assert main([str(write(tmp_path, "[train]\nsede = 1\n"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.sede" in err[0] and "seed" in err[0]


def test_plan_job_reports_packing(capsys):
    assert main(["configs/demo.toml", "--job.kind=plan"]) == 0
    out = capsys.readouterr().out
    assert "compression" in out and "compact tokens" in out


def test_to_toml_shows_unset_values_as_none(tmp_path):
    printed = to_toml(load_config(JobConfig, None, ["--checkpoint.export_dir=none"]))
    assert 'hf_path = "none"' in printed and 'export_dir = "none"' in printed
    again = load_config(JobConfig, write(tmp_path, printed))
    assert again.model.hf_path is None and again.checkpoint.export_dir is None


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
        (["--data.tasks=nowhere/*.jsonl"], r"`data.tasks`: '.*/nowhere/\*.jsonl' matches no file"),
        (["--data.epochs=0"], r"`data.epochs` must be >= 1 or unset, got 0"),
        (["--parallel.activation_checkpointing=selective", "--parallel.selective.every=99"],
         r"\[parallel.selective\]: `every` = 99 selects no layer: the model has \d+ layer\(s\)"),
        (["--parallel.activation_checkpointing=selective", "--parallel.ep=2"],
         r"\[parallel\] `parallel.activation_checkpointing` = 'selective' with `parallel.ep` = 2"),
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


def test_paths_follow_the_shell(tmp_path, monkeypatch):
    """File paths are relative to the file, override paths to the current folder, defaults to the file's folder."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "shell").mkdir()
    path = write(tmp_path / "conf", "[checkpoint]\ndir = 'ck'\n[metrics]\nlog_dir = 'tb'\n")
    monkeypatch.chdir(tmp_path / "shell")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = load_config(JobConfig, "../conf/job.toml", ["--checkpoint.export_dir=out/hf", "--metrics.log_dir=~/tb"])
    assert config.checkpoint.dir == str(tmp_path / "conf" / "ck")
    assert config.checkpoint.export_dir == str(tmp_path / "shell" / "out" / "hf")
    assert config.metrics.log_dir == str(tmp_path / "home" / "tb")
    assert load_config(JobConfig, path).checkpoint.export_dir == str(tmp_path / "conf" / "outputs" / "hf")


def test_none_unsets_optional_settings(tmp_path):
    path = write(tmp_path, "[train]\nsft_lr = 0.1\n[checkpoint]\nexport_dir = 'none'\n")
    assert load_config(JobConfig, path).checkpoint.export_dir is None
    config = load_config(JobConfig, path, ["--train.sft_lr=none", "--model.hidden_size=none"])
    assert config.train.sft_lr is None and config.model.hidden_size is None
