"""The RL job's tasks from `[data] tasks`: the feed's checkpoint state, its errors, path resolution, and whole jobs
(torch engine, coin environment reading {"coin": int} records) that resume at the next unseen record, end cleanly
when the epochs are used up, and stop at a bad record with a checkpoint to resume from after the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.__main__ import main
from app.checkpoint import Checkpointer
from app.config import JobConfig
from app.config_loader import load_config
from app.data import DataConfig, DataExhausted, RecordStream, TaskFeed, build_task_feed
from app.errors import ConfigError
from rollout import demonstration_tree
from rollout.chat_template import ChatTemplate
from rollout.envs import AnswerEnv, CalculatorEnv, Environment
from rollout.rendered_env import RenderedEnvironment
from tests.app.coin_env import CoinEnv
from tests.app.jobs import recording_batches, write_job
from tests.app.test_rl_job import models_equal
from tests.rollout.qwen_tokenizer import qwen_style_tokenizer


def coins(path: Path, count: int = 13, bad: dict[int, str] | None = None) -> Path:
    """`count` records {"coin": i}; `bad` replaces line numbers (1-based) with other text."""
    lines = [json.dumps({"coin": i}) for i in range(count)]
    for number, text in (bad or {}).items():
        lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def test_feed_state_is_that_of_the_last_completed_step(tmp_path):
    feed = TaskFeed(RecordStream([coins(tmp_path / "c.jsonl")], CoinEnv().task_from_record, shuffle=False))
    assert feed.tasks(3, step=1) == [0, 1, 2]
    after_one = feed.state_dict(completed_steps=1)
    assert feed.tasks(3, step=2) == [3, 4, 5]
    # Step 2 has not completed (say its rollout failed): its tasks are drawn again after a resume.
    assert feed.state_dict(completed_steps=1) == after_one
    assert feed.state_dict(completed_steps=2)["position"] == 6
    again = TaskFeed(RecordStream([tmp_path / "c.jsonl"], CoinEnv().task_from_record, shuffle=False))
    again.load_state_dict(after_one)
    assert again.tasks(3, step=2) == [3, 4, 5]


def test_exhausted_feed_names_the_step(tmp_path):
    feed = TaskFeed(RecordStream([coins(tmp_path / "c.jsonl", 5)], CoinEnv().task_from_record, epochs=1))
    feed.tasks(3, step=1)
    with pytest.raises(DataExhausted, match="the 1 epoch.* of 5 task records are used up: step 2 needs 3 tasks, "
                                            "2 were left"):
        feed.tasks(3, step=2)


def test_feed_needs_records_the_environment_reads(tmp_path):
    assert build_task_feed(DataConfig(), CalculatorEnv(), seed=0) is None
    with pytest.raises(ConfigError, match="environment 'answer' has no task generator: set \\[data\\] tasks"):
        build_task_feed(DataConfig(), AnswerEnv(), seed=0)

    class NoRecords(CalculatorEnv):
        task_from_record = Environment.task_from_record

    data = DataConfig(tasks=str(coins(tmp_path / "c.jsonl")))
    with pytest.raises(ConfigError, match="environment 'calculator' does not read task records"):
        build_task_feed(data, NoRecords(), seed=0)


def test_patterns_resolve_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "data" / "more").mkdir(parents=True)
    for name in ("b.jsonl", "a.jsonl", "more/c.jsonl"):
        coins(tmp_path / "data" / name, 2)
    job = tmp_path / "job.toml"
    job.write_text('[data]\ntasks = ["data/*.jsonl", "data/**/*.jsonl"]\n')
    monkeypatch.chdir(tmp_path / "data" / "more")  # the shell's folder does not matter for paths in the file
    data = load_config(JobConfig, job).data
    assert [p.relative_to(tmp_path).as_posix() for p in data.files()] == \
        ["data/a.jsonl", "data/b.jsonl", "data/more/c.jsonl"]
    for pattern, error in (("nothing/*.jsonl", r"`data.tasks`: '.*/nothing/\*.jsonl' matches no file"),
                           ("data/d.*", r"d.csv is neither .jsonl nor .parquet")):
        (tmp_path / "data" / "d.csv").write_text("coin\n1\n")
        job.write_text(f'[data]\ntasks = "{pattern}"\n')
        with pytest.raises(ConfigError, match=error):
            load_config(JobConfig, job)


DATA_JOB = """
[data]
tasks = "coins.jsonl"
prefetch = 2
"""


@pytest.fixture
def tasks_per_step(monkeypatch):
    """Every step's tasks as the job received them: {step: [coin, ...]}, one dict per run."""
    return recording_batches(monkeypatch)


def job(folder: Path, extra: str = "", **bad) -> Path:
    folder.mkdir()
    coins(folder / "coins.jsonl", 13, **bad)
    return write_job(folder, extra=DATA_JOB + extra)


def test_resumed_job_sees_the_same_records_and_reaches_the_same_parameters(tmp_path, tasks_per_step):
    run, runs = tasks_per_step
    a, b = job(tmp_path / "a"), job(tmp_path / "b")
    assert run(str(a)) == 0
    # 2 SFT + 4 RL steps of 3 tasks: 18 records, an epoch of 13 and 5 of the next.
    first_epoch = [t for step in (1, 2, 3, 4) for t in runs[0][step]] + runs[0][5][:1]
    assert sorted(first_epoch) == list(range(13))
    assert run(str(b), "--train.steps=1") == 0  # stops after step 3: mid-epoch (9 records)
    assert run(str(b), "--resume") == 0
    assert {**runs[1], **runs[2]} == runs[0] and sorted(runs[2]) == [4, 5, 6]
    final_a, final_b = Checkpointer(tmp_path / "a" / "ck").load(), Checkpointer(tmp_path / "b" / "ck").load()
    assert models_equal(final_a["model"], final_b["model"])
    assert json.loads(json.dumps(final_b["data"])) == final_a["data"]
    assert final_a["data"]["epoch"] == 1 and final_a["data"]["position"] == 5


def test_used_up_epochs_end_the_run_cleanly(tmp_path, capsys):
    config = job(tmp_path / "a", "epochs = 1\n")
    assert main([str(config)]) == 0
    out = capsys.readouterr().out
    assert "data: the 1 epoch(s) of 13 task records are used up: step 5 needs 3 tasks, 1 were left; stopping " \
           "after step 4" in out
    state = Checkpointer(tmp_path / "a" / "ck").load()
    assert state["progress"] == {"sft_done": 2, "rl_done": 2}
    assert (tmp_path / "a" / "hf" / "config.json").is_file()


def test_bad_record_stops_with_a_checkpoint_and_the_fixed_file_resumes(tmp_path, capsys, tasks_per_step):
    run, runs = tasks_per_step
    unshuffled = "shuffle = false\n"
    config = job(tmp_path / "a", unshuffled, bad={8: '{"coin": "x"}'})
    assert run(str(config)) == 2
    out = capsys.readouterr().out
    assert "error: bad task record at step 3: " in out
    assert "coins.jsonl:8: field 'coin': must be an integer, got 'x' (str); fix the record or set " \
           "data.on_bad_record = \"skip\"" in out
    state = Checkpointer(tmp_path / "a" / "ck").load()
    assert state["progress"] == {"sft_done": 2, "rl_done": 0} and state["data"]["position"] == 6
    coins(tmp_path / "a" / "coins.jsonl", 13)
    assert run(str(config), "--resume") == 0
    assert runs[1][3] == [6, 7, 8] and sorted(runs[1]) == [3, 4, 5, 6]


def test_skipped_records_are_printed_and_counted(tmp_path, capsys):
    config = job(tmp_path / "a", 'shuffle = false\non_bad_record = "skip"\n', bad={2: "{oops", 5: '{"x": 1}'})
    assert main([str(config)]) == 0
    out = capsys.readouterr().out
    assert "data: skipped " in out and "coins.jsonl:2: unreadable line: invalid JSON" in out
    assert "coins.jsonl:5: field 'coin': missing" in out
    assert Checkpointer(tmp_path / "a" / "ck").load()["data"]["skipped"] == 4  # both, in epochs 1 and 2


ROOT = Path(__file__).resolve().parents[3]


def test_bundled_datasets_parse_and_their_demonstrations_earn_reward():
    calculator = load_config(JobConfig, ROOT / "configs" / "calculator-data.toml")
    tasks = list(RecordStream(calculator.data.files(), CalculatorEnv().task_from_record, epochs=1, prefetch=0))
    assert len(tasks) == 147 and {t.answer for t in tasks} >= {-6, 0, 36}

    answers = load_config(JobConfig, ROOT / "configs" / "answers-hf.toml")
    env = RenderedEnvironment(AnswerEnv(**answers.rollout.env_options), ChatTemplate(qwen_style_tokenizer()))
    tokenizer = env.template.tokenizer
    for i, task in enumerate(RecordStream(answers.data.files(), env.task_from_record, epochs=1, prefetch=0)):
        (trajectory,) = demonstration_tree(env, task, tokenizer, i).trajectories()
        assert trajectory.reward == 1.0


def test_two_ranks_resume_the_records_through_the_distributed_checkpoint(tmp_path):
    """Rank 0 reads the records; its data state goes into the DCP checkpoint and comes back on --resume: at every
    step the run's data state is that of an uninterrupted 2-rank run and of one process (the same records in the
    same order), its parameters are bitwise those of the uninterrupted 2-rank run, and it equals one uninterrupted
    process (same trees, losses and parameters to 1e-9)."""
    from tests.app.test_distributed import FLOAT64_JOB, assert_same_run, launch

    want, got, whole = job(tmp_path / "one"), job(tmp_path / "two"), job(tmp_path / "whole")
    assert main([str(want), *FLOAT64_JOB]) == 0
    launch(whole.parent, 2, *FLOAT64_JOB, "--parallel.dp_shard=2")
    launch(got.parent, 2, *FLOAT64_JOB, "--parallel.dp_shard=2", "--train.steps=1")
    out = launch(got.parent, 2, *FLOAT64_JOB, "--parallel.dp_shard=2", "--resume")
    assert "resumed from" in out and "RL step   2/2" in out
    assert_same_run(got.parent, want.parent)
    runs = [Checkpointer(folder.parent / "ck") for folder in (got, whole, want)]
    for step in runs[0].steps():
        data = [ck.load(ck.path(step))["data"] for ck in runs]
        assert data[0] == data[1] == data[2], step
    assert models_equal(runs[0].load()["model"], runs[1].load()["model"])
