import pytest

from app.__main__ import main
from app.config import ConfigError, JobConfig
from app.config_loader import load_config, parse_overrides, to_toml


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_and_file_values(tmp_path):
    config = load_config(JobConfig, write(tmp_path, "[planner]\ncapacity = 128\n[parallel]\ndp = 2\n"))
    assert config.planner.capacity == 128 and config.parallel.dp == 2
    assert config.planner.chunk_size == 64


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
    ],
)
def test_errors_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(JobConfig, write(tmp_path, text), overrides)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(JobConfig, tmp_path / "nope.toml")


def test_print_config_round_trips(tmp_path, capsys):
    assert main([str(write(tmp_path, "[planner]\ncapacity = 77\n")), "--print-config", "--parallel.dp=4"]) == 0
    printed = capsys.readouterr().out
    again = load_config(JobConfig, write(tmp_path, printed))
    assert again.planner.capacity == 77 and again.parallel.dp == 4


def test_bad_config_exits_2_with_one_line(tmp_path, capsys):
    assert main([str(write(tmp_path, "[train]\nsede = 1\n"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.sede" in err[0] and "seed" in err[0]


def test_default_job_reports_packing(capsys):
    assert main(["configs/demo.toml"]) == 0
    out = capsys.readouterr().out
    assert "compression" in out and "compact tokens" in out


def test_to_toml_shows_unset_values():
    assert "# hf_path = (unset)" in to_toml(JobConfig())
