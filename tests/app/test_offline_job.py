"""The offline job (`[job] kind = "offline"`, app/offline_job.py) end to end on recorded calculator trees
(configs/data/calculator_trees.jsonl): it trains with SFT and with the RL objective on whole shuffled trees, a run
stopped mid-epoch and resumed reads the same trees in the same order and reaches bitwise the same parameters
(float64, one thread; in one process and on 2 gloo ranks), and every bad record or setting is one error line naming
where it is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.__main__ import WARNED_ENV, main
from app.checkpoint import Checkpointer
from app.config import JobConfig
from app.config_loader import load_config
from app.errors import ConfigError
from app.policy import build_policy
from models.hf_io import load_hf
from models.microbatch import prepare_microbatch
from models.step import Step
from parallel.plain_runner import PlainRunner
from planner.jsonl import read_jsonl
from tests.app.jobs import OUTPUTS, recording_batches
from tests.app.offline_trees import calculator_trees
from tests.app.test_distributed import launch, scalars
from tests.app.test_rl_job import events, models_equal

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "data" / "calculator_trees.jsonl"

OFFLINE_JOB = """
[job]
kind = "offline"
objective = "rl"

[model]
vocab_size = 128
hidden_size = 64

[data]
trajectories = "trees.jsonl"
prefetch = 2

[planner]
# Several microbatches per step: gradients accumulate across them.
capacity = 48

[train]
threads = 1
trees_per_step = 2
steps = 5
lr = 3e-3

[rl]
# The recorded behaviour log-probs are those of another model (configs/offline.toml's): no importance weights.
tis_cap = "none"
""" + OUTPUTS
FLOAT64 = ["--model.dtype=float64", "--train.moe_aux_loss_coef=0"]
#: Steps of 6 records instead of 2 trees (records without tree ids).
RECORDS = ["--train.trees_per_step=none", "--train.trajectories_per_step=6"]


def offline_job(folder: Path, lines: list[str] | None = None) -> Path:
    """A job folder with `lines` as trees.jsonl (default: the example's first 8 trees, 32 records, 4 steps an
    epoch)."""
    folder.mkdir()
    lines = EXAMPLE.read_text().splitlines()[:32] if lines is None else lines
    (folder / "trees.jsonl").write_text("\n".join(lines) + "\n")
    path = folder / "job.toml"
    path.write_text(OFFLINE_JOB)
    return path


@pytest.fixture
def records_per_step(monkeypatch):
    """Every step's trees as the job received them: {step: [(tree id, [tokens of each path]) of each tree]}, one dict
    per run."""
    return recording_batches(monkeypatch, lambda tree: (tree[0].tree, [t.tokens.tolist() for t in tree]))


def test_bundled_example_is_what_its_generator_writes():
    want, got = calculator_trees(), read_jsonl(EXAMPLE)
    assert len(got) == len(want) == 96 and EXAMPLE.stat().st_size < 100_000
    for a, b in zip(got, want):
        assert a.tokens.tolist() == b.tokens.tolist() and (a.loss_mask == b.loss_mask).all()
        assert a.reward == b.reward and a.tree == b.tree and np.array_equal(a.advantage, b.advantage)
        assert np.abs(a.logprobs - b.logprobs).max() <= 2e-4  # 4 decimals, recomputed in float32


def answer_logprob_gap(model, trajectories) -> float:
    """Mean log-prob of the right final answers minus that of the wrong ones (their last 4 tokens)."""
    with torch.no_grad():
        step = Step.self_contained([prepare_microbatch(trajectories, model.config, torch.device("cpu"))])
        (logprobs,) = PlainRunner(model).score(step)
    offsets = np.cumsum([0] + [len(t) for t in trajectories])
    answer = np.array([logprobs[hi - 4:hi].mean().item() for hi in offsets[1:]])
    right = np.array([t.reward == 1.0 for t in trajectories])
    return float(answer[right].mean() - answer[~right].mean())


@pytest.mark.parametrize("objective", ["rl", "sft"])
def test_offline_job_trains_on_the_recorded_trees(tmp_path, capsys, objective):
    """RL on the recorded advantages widens the log-prob gap between right and wrong answers; SFT lowers the NLL
    (all paths alike, so it does not). Checkpoints, TensorBoard tags and the export as in an RL job."""
    config = offline_job(tmp_path / "a", EXAMPLE.read_text().splitlines())
    assert main([str(config), f"--job.objective={objective}", "--data.epochs=2", "--train.steps=100",
                 "--train.trees_per_step=4"]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert "offline step  12/12" in out and "exported the policy" in out
    assert "data: the 2 epoch(s) of 24 trees hold 12 steps of 4 trees (`train.steps` = " in out
    checkpoints = Checkpointer(tmp_path / "a" / "ck")
    assert checkpoints.load()["progress"] == {"offline_done": 12}
    acc = events(tmp_path / "a")
    prefix = "train" if objective == "rl" else "sft"
    loss = [e.value for e in acc.Scalars(f"{prefix}/loss")]
    assert [e.step for e in acc.Scalars(f"{prefix}/loss")] == list(range(1, 13))
    assert {e.value for e in acc.Scalars("data/trees")} == {4.0}
    assert {e.value for e in acc.Scalars("data/records")} == {16.0}
    for tag in ("data/reward_mean", "train/compression", "time/step", f"{prefix}/entropy"):
        assert tag in acc.Tags()["scalars"], tag
    trees = read_jsonl(EXAMPLE)
    initial, _ = build_policy(load_config(JobConfig, config).model, seed=0)
    trained = load_hf(tmp_path / "a" / "hf")
    before, after = answer_logprob_gap(initial, trees), answer_logprob_gap(trained, trees)
    print(f"{objective}: {prefix}/loss {loss[0]:.3f} -> {loss[-1]:.3f}, right-minus-wrong answer log-prob "
          f"{before:.3f} -> {after:.3f}")
    if objective == "rl":
        assert after > before + 0.5
    else:
        nll = [e.value for e in acc.Scalars("sft/nll")]
        assert nll[-1] < 0.6 * nll[0]


@pytest.mark.parametrize("extra", [[], ["--rl.epochs=2", "--planner.mode=carry"], ["--job.objective=sft"]],
                         ids=["rl", "rl-epochs2-carry", "sft"])
def test_stopped_mid_epoch_and_resumed_equals_uninterrupted(tmp_path, records_per_step, extra):
    """4 steps of 2 whole trees over an epoch of 8 trees (32 records): every step takes whole trees, an epoch reads
    each tree once in a shuffled order; stopped after step 2 (4 trees into the epoch) and resumed, the run reads the
    same trees in the same order as an uninterrupted one, and its parameters and AdamW state are bitwise those of
    the uninterrupted run (float64, one thread)."""
    run, runs = records_per_step
    a, b = offline_job(tmp_path / "a"), offline_job(tmp_path / "b")
    assert run(str(a), *FLOAT64, *extra, "--train.steps=7") == 0
    first_epoch = [tree for step in (1, 2, 3, 4) for tree in runs[0][step]]
    records = [json.loads(line) for line in (tmp_path / "a" / "trees.jsonl").read_text().splitlines()]
    in_file = [(tree, [r["tokens"] for r in records if r["tree"] == tree]) for tree in dict.fromkeys(r["tree"]
                                                                                                   for r in records)]
    assert len(in_file) == 8 and all(len(paths) == 4 for _, paths in in_file)
    assert all(len(runs[0][step]) == 2 for step in runs[0])
    # An epoch reads each tree whole and once, in an order other than the file's, and the next epoch reshuffles.
    assert sorted(first_epoch) == sorted(in_file) and first_epoch != in_file
    assert runs[0][5] != runs[0][1]
    assert run(str(b), *FLOAT64, *extra, "--train.steps=2") == 0
    assert run(str(b), *FLOAT64, *extra, "--train.steps=7", "--resume") == 0
    assert sorted(runs[2]) == [3, 4, 5, 6, 7] and {**runs[1], **runs[2]} == runs[0]
    final_a, final_b = Checkpointer(tmp_path / "a" / "ck").load(), Checkpointer(tmp_path / "b" / "ck").load()
    assert final_a["progress"] == final_b["progress"] == {"offline_done": 7}
    assert models_equal(final_a["model"], final_b["model"])
    assert models_equal(final_a["optimizer"], final_b["optimizer"])
    assert final_b["data"] == final_a["data"] and final_a["data"]["epoch"] == 1 and final_a["data"]["position"] == 6


GOOD = '{"tokens": [2, 4, 10, 84, 12], "loss_mask": [0, 0, 1, 1, 1], "advantage": 1.0}'
#: A path one token longer than the model's max_position_embeddings (4096, tiny-qwen3-next).
BEYOND_POSITIONS = json.dumps({"tokens": [2] * 4097, "advantage": 1.0})
LOG_PROBS = "must hold log-probabilities (finite numbers <= 0; 0 for a token without one)"


def with_field(text: str) -> str:
    """GOOD with one more key (`text`: '"key": value')."""
    return GOOD[:-1] + ", " + text + "}"


@pytest.mark.parametrize("line, error", [
    ('{"loss_mask": [0, 1]}', "missing required key 'tokens'"),
    ('{"tokens": "2 4 10"}', "'tokens' must be a non-empty list of integers"),
    ('{"tokens": [2, 4, 10], "loss_mask": [0, 1]}',
     "`loss_mask` must be a scalar or have one entry per token (3), got shape (2,)"),
    ('{"tokens": [2, 4, 10], "advantage": 1.0, "weight": "high"}', "'weight' must be a number, got \"high\""),
    ('{"tokens": [2, 4, 10], "advantage": 1.0, "los_mask": [0, 1, 1]}', "unknown key 'los_mask' (did you mean "
                                                                         "'loss_mask'?)"),
    ('{"tokens": [2, 4, 10', "unreadable line: invalid JSON (Expecting ',' delimiter at column 1)"),
    ('{"tokens": [2, 4, 300], "advantage": 1.0}', "field 'tokens': token id 300 is outside the model's vocabulary "
                                                   "of 128 ids (the records must be tokenized with the model's "
                                                   "tokenizer)"),
    ('{"tokens": [2, 4, 10], "reward": 1.0}', "field 'advantage': missing: job.objective = 'rl' trains on the "
                                               "recorded advantages"),
    (BEYOND_POSITIONS, "field 'tokens': path of 4,097 tokens exceeds the model's max_position_embeddings 4096: "
                       "shorten or drop it"),
    (GOOD.replace('"advantage": 1.0', '"advantage": NaN'), "field 'advantage': must be a finite number, got NaN"),
    (with_field('"weight": Infinity'), "field 'weight': must be a finite number, got Infinity"),
    (with_field('"weight": NaN'), "field 'weight': must be a finite number, got NaN"),
    (with_field('"ref_logprobs": [0, -0.5, NaN, -1.0, -2.0]'),
     f"field 'ref_logprobs': {LOG_PROBS}, got NaN at index 2 (of 5 tokens)"),
    (with_field('"logprobs": [0, -0.5, Infinity, -1.0, -2.0]'),
     f"field 'logprobs': {LOG_PROBS}, got Infinity at index 2 (of 5 tokens)"),
    (with_field('"logprobs": [0, -0.5, -1.0, 0.25, -2.0]'),
     f"field 'logprobs': {LOG_PROBS}, got 0.25 at index 3 (of 5 tokens)"),
], ids=["no-tokens", "tokens-type", "mask-length", "weight-type", "unknown-key", "json", "vocab", "no-advantage",
        "beyond-positions", "nan-advantage", "inf-weight", "nan-weight", "nan-ref-logprobs", "inf-logprobs",
        "positive-logprobs"])
def test_a_bad_record_stops_with_its_file_line_and_field(tmp_path, capsys, line, error):
    config = offline_job(tmp_path / "a", [GOOD] * 7 + [line] + [GOOD] * 4)
    assert main([str(config), *RECORDS, "--data.shuffle=false"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    (message,) = [m for m in out.splitlines() if m.startswith("error:")]
    assert message == f"error: bad trajectory record at step 2: {tmp_path / 'a' / 'trees.jsonl'}:8: {error}; fix " \
                      "the record or set data.on_bad_record = \"skip\"", message
    # The checkpoint of step 1 (--resume after the fix reads step 2's records again).
    state = Checkpointer(tmp_path / "a" / "ck").load()
    assert state["progress"] == {"offline_done": 1} and state["data"]["position"] == 6


def test_the_objective_names_the_fields_it_needs(tmp_path, capsys):
    config = offline_job(tmp_path / "a", [GOOD] * 12)
    assert main([str(config), *RECORDS, "--rl.tis_cap=2.0", "--data.shuffle=false"]) == 2
    assert "trees.jsonl:1: field 'logprobs': missing: rl.tis_cap = 2.0 weights tokens by the behaviour log-probs " \
           "(or set it to none)" in capsys.readouterr().out
    assert main([str(config), *RECORDS, "--rl.kl_coef=0.1"]) == 2
    assert "field 'ref_logprobs': missing: rl.kl_coef = 0.1 needs the reference log-probs" in capsys.readouterr().out
    no_advantage = GOOD.replace(', "advantage": 1.0', "")
    config = offline_job(tmp_path / "b", [no_advantage] * 12)
    assert main([str(config), *RECORDS, "--job.objective=sft", "--train.steps=2"]) == 0


def test_skipped_records_are_printed_and_counted(tmp_path, capsys):
    config = offline_job(tmp_path / "a", [GOOD] * 3 + ["{oops"] + [GOOD] * 8 + ['{"tokens": []}'])
    assert main([str(config), *RECORDS, "--data.on_bad_record=skip", "--data.shuffle=false", "--train.steps=4"]) == 0
    out = capsys.readouterr().out
    assert "data: skipped " in out and "trees.jsonl:4: unreadable line: invalid JSON" in out
    assert "trees.jsonl:13: 'tokens' must be a non-empty list of integers" in out
    # Lines 4 and 13 of epochs 1 and 2 (24 records of 11 per epoch).
    assert Checkpointer(tmp_path / "a" / "ck").load()["data"]["skipped"] == 4


def test_empty_data_is_an_error(tmp_path, capsys):
    config = offline_job(tmp_path / "a", ["", "  "])
    assert main([str(config)]) == 2
    assert f"error: no records in {tmp_path / 'a' / 'trees.jsonl'} (every line is blank)" in capsys.readouterr().err


def test_a_path_longer_than_a_microbatch_is_a_bad_record_in_duplicate_mode_only(tmp_path, capsys):
    """Duplicate mode runs every path whole in one microbatch: a 60-token path with planner.capacity = 48 stops the
    run naming its line (after the checkpoint of step 1), or is skipped and counted; carry mode cuts it and trains."""
    long = json.dumps({"tokens": [2, 4] * 30, "advantage": 1.0})
    config = offline_job(tmp_path / "a", [GOOD] * 7 + [long] + [GOOD] * 4)
    args = [str(config), *RECORDS, "--data.shuffle=false", "--train.steps=2"]
    assert main([*args, "--planner.mode=duplicate"]) == 2
    out = capsys.readouterr().out
    (message,) = [m for m in out.splitlines() if m.startswith("error:")]
    path = tmp_path / "a" / "trees.jsonl"
    assert message == f"error: bad trajectory record at step 2: {path}:8: field 'tokens': path of 60 tokens exceeds " \
                      "planner.capacity = 48: duplicate mode runs every path whole in one microbatch (a tree may " \
                      "span several); shorten or drop it, raise planner.capacity to at least its length, or set " \
                      "planner.mode = 'carry' or 'auto' (without pipeline parallelism), which cut paths; fix the " \
                      "record or set data.on_bad_record = \"skip\"", message
    assert Checkpointer(tmp_path / "a" / "ck").load()["progress"] == {"offline_done": 1}
    assert main([*args, "--planner.mode=duplicate", "--data.on_bad_record=skip"]) == 0
    assert f"data: skipped {path}:8: field 'tokens': path of 60 tokens exceeds planner.capacity = 48" in \
        capsys.readouterr().out
    assert Checkpointer(tmp_path / "a" / "ck").load()["data"]["skipped"] == 1
    assert main([*args, "--planner.mode=carry"]) == 0


def test_a_nan_advantage_skips_its_tree_not_the_step(tmp_path, capsys, records_per_step):
    """Line 10 (in tree calc-2, lines 9-12) has a NaN advantage: "skip" leaves out the 4 paths of calc-2 and counts
    them, and every step trains on finite trees (a NaN advantage would make the whole step's loss NaN)."""
    run, runs = records_per_step
    lines = EXAMPLE.read_text().splitlines()[:32]
    lines[9] = json.dumps({**json.loads(lines[9]), "advantage": float("nan")})
    config = offline_job(tmp_path / "a", lines)
    assert run(str(config), "--data.shuffle=false", "--data.on_bad_record=skip", "--train.steps=2") == 0
    out = capsys.readouterr().out
    assert f"data: skipped {tmp_path / 'a' / 'trees.jsonl'}:10: field 'advantage': must be a finite number, got " \
           "NaN (with the other 3 records of its tree)" in out
    assert [[tree for tree, _ in runs[0][step]] for step in (1, 2)] == [["calc-0", "calc-1"], ["calc-3", "calc-4"]]
    assert scalars(tmp_path / "a", "train/skipped") == {1: 0.0, 2: 0.0}
    assert Checkpointer(tmp_path / "a" / "ck").load()["data"]["skipped"] == 4


def test_a_tree_whose_lines_are_not_consecutive_is_an_error(tmp_path, capsys):
    lines = EXAMPLE.read_text().splitlines()
    config = offline_job(tmp_path / "a", lines[:3] + lines[4:8] + lines[3:4])
    assert main([str(config)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    path = tmp_path / "a" / "trees.jsonl"
    (message,) = [m for m in (out + err).splitlines() if m.startswith("error:")]
    assert message == f"error: {path}:8: tree 'calc-0' reappears after other records (it began at {path}:1): the " \
                      "records of one tree must be consecutive lines of one file; move them together or give them " \
                      "another tree id", message


def test_steps_of_records_on_trees_are_an_error(tmp_path, capsys):
    config = offline_job(tmp_path / "a")
    assert main([str(config), *RECORDS]) == 2
    out, err = capsys.readouterr()
    (message,) = [m for m in (out + err).splitlines() if m.startswith("error:")]
    assert message == f"error: {tmp_path / 'a' / 'trees.jsonl'}:1 begins a tree of 4 paths (records with one `tree` " \
                      "id): train.trajectories_per_step would split trees across steps; set train.trees_per_step " \
                      "(whole trees per step) instead", message


def test_a_bad_line_inside_a_tree_stops_or_skips_the_whole_tree(tmp_path, capsys, records_per_step):
    """Line 10 (in tree calc-2, lines 9-12) is no JSON: "error" stops at step 2 (calc-2, calc-3) naming the line,
    after the checkpoint of step 1; "skip" leaves out all 4 paths of calc-2 and counts them."""
    run, runs = records_per_step
    lines = EXAMPLE.read_text().splitlines()[:32]
    config = offline_job(tmp_path / "a", lines[:9] + ["{oops"] + lines[10:])
    assert run(str(config), "--data.shuffle=false") == 2
    out = capsys.readouterr().out
    path = tmp_path / "a" / "trees.jsonl"
    (message,) = [m for m in out.splitlines() if m.startswith("error:")]
    assert message.startswith(f"error: bad trajectory record at step 2: {path}:10: unreadable line: invalid JSON"), \
        message
    state = Checkpointer(tmp_path / "a" / "ck").load()
    assert state["progress"] == {"offline_done": 1} and state["data"]["position"] == 2
    config = offline_job(tmp_path / "b", lines[:9] + ["{oops"] + lines[10:])
    assert run(str(config), "--data.shuffle=false", "--data.on_bad_record=skip", "--train.steps=3") == 0
    out = capsys.readouterr().out
    assert f"data: skipped {path.parent.parent / 'b' / 'trees.jsonl'}:10: unreadable line" in out
    assert "(with the other 3 records of its tree)" in out
    trees = [[tree for tree, _ in runs[1][step]] for step in (1, 2, 3)]
    assert trees == [["calc-0", "calc-1"], ["calc-3", "calc-4"], ["calc-5", "calc-6"]]
    assert all(len(paths) == 4 for step in runs[1].values() for _, paths in step)
    assert Checkpointer(tmp_path / "b" / "ck").load()["data"]["skipped"] == 4


@pytest.mark.parametrize("text, error", [
    ('[data]\ntrajectories = "trees.jsonl"\n',
     "`data.trajectories` is read by offline jobs only, but `job.kind` = 'rl': set job.kind = 'offline' or remove it"),
    ('[job]\nkind = "offline"\n', "`job.kind` = 'offline' needs [data] trajectories = \"PATH or glob\""),
    ('[job]\nobjective = "rl"\n', "`job.objective` is read by offline jobs only, but `job.kind` = 'rl'"),
    ('[job]\nkind = "offline"\n[data]\ntrajectories = "trees.jsonl"\ntasks = "trees.jsonl"\n',
     "`data.tasks` and `data.trajectories` are both set"),
    ('[train]\ntrees_per_step = 2\n', "`train.trees_per_step` is read by offline jobs only, but `job.kind` = 'rl': "
                                     "remove it"),
    ('[job]\nkind = "offline"\n[data]\ntrajectories = "nothing/*.jsonl"\n',
     r"`data.trajectories`: '.*/nothing/\*.jsonl' matches no file"),
    ('[job]\nkind = "offline"\n[data]\ntrajectories = "job.toml"\n', r"`data.trajectories`: .*job.toml is not a "
                                                                     r"\.jsonl file"),
], ids=["trajectories-in-rl", "offline-without-trajectories", "objective-in-rl", "tasks-and-trajectories",
        "trees-in-rl", "no-match", "not-jsonl"])
def test_config_errors(tmp_path, text, error):
    (tmp_path / "trees.jsonl").write_text(GOOD + "\n")
    (tmp_path / "job.toml").write_text(text)
    with pytest.raises(ConfigError, match=error if "\\" in error else error.replace("[", r"\[").replace("(", r"\(")):
        load_config(JobConfig, tmp_path / "job.toml")


def test_two_ranks_stopped_mid_epoch_and_resumed_equal_uninterrupted(tmp_path):
    """On 2 gloo ranks (FSDP2 over dp_shard = 2): stopped after step 2 and resumed, the run reads the records of an
    uninterrupted 2-rank run at every step (the checkpoints' data states, the main rank reads for both replicas)
    with bitwise-equal losses and parameters; and the records are those one process reads."""
    two = ["--parallel.dp_shard=2", *FLOAT64, "--train.steps=8"]
    want, got, one = offline_job(tmp_path / "want"), offline_job(tmp_path / "got"), offline_job(tmp_path / "one")
    launch(want.parent, 2, *two)
    launch(got.parent, 2, *two[:-1], "--train.steps=2")
    out = launch(got.parent, 2, *two, "--resume")
    assert "resumed from" in out and "offline step   8/8" in out
    assert main([str(one), *FLOAT64, "--train.steps=8"]) == 0
    runs = {name: Checkpointer(tmp_path / name / "ck") for name in ("want", "got", "one")}
    for step in range(1, 9):
        states = {name: ck.load(ck.path(step)) for name, ck in runs.items()}
        assert states["got"]["data"] == states["want"]["data"] == states["one"]["data"], step
    final = {name: ck.load() for name, ck in runs.items()}
    assert models_equal(final["got"]["model"], final["want"]["model"])
    assert models_equal(final["got"]["optimizer"], final["want"]["optimizer"])
    assert scalars(got.parent, "train/loss") == scalars(want.parent, "train/loss")
    want, one = final["want"]["model"], final["one"]["model"]
    worst = max((want[k] - one[k]).abs().max().item() for k in one)
    assert worst < 1e-9, worst  # the same records in one process: only the summation order differs


def test_kl_is_taken_to_the_recorded_reference_log_probs(tmp_path):
    """rl.kl_coef > 0 reads each record's ref_logprobs (here its behaviour log-probs, of a wider model): the KL is
    positive from the first step, and no frozen reference policy is kept or checkpointed."""
    lines = [json.dumps({**json.loads(line), "ref_logprobs": json.loads(line)["logprobs"]})
             for line in EXAMPLE.read_text().splitlines()[:32]]
    config = offline_job(tmp_path / "a", lines)
    assert main([str(config), "--rl.kl_coef=0.5", "--train.steps=2"]) == 0
    kl = scalars(tmp_path / "a", "train/kl")
    assert sorted(kl) == [1, 2] and min(kl.values()) > 0, kl
    assert Checkpointer(tmp_path / "a" / "ck").load()["reference"] is None


def test_settings_an_offline_job_ignores_are_named_once(tmp_path, capsys):
    config = offline_job(tmp_path / "a")
    assert main([str(config), "--train.steps=1", "--rollout.env=calculator", "--rollout.tasks_per_step=3",
                 "--train.sft_steps=2", "--rollout.temperature=0.7", "--rl.advantages=siblings"]) == 0
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning == "warning: an offline job (objective 'rl') ignores rollout.tasks_per_step, train.sft_steps, " \
                      "rl.advantages"
    assert main([str(config), "--train.steps=1", "--job.objective=sft", "--rollout.temperature=0.7",
                 "--rl.clip_low=0.1"]) == 0
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    # The job file sets rl.tis_cap.
    assert warning == "warning: an offline job (objective 'sft') ignores rollout.temperature, rl.clip_low, " \
                      "rl.tis_cap"
    assert main([str(config), "--train.steps=1", "--train.trajectories_per_step=8"]) == 0
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warning == "warning: an offline job (objective 'rl') ignores train.trajectories_per_step"


def test_ranks_relaunched_by_the_entry_point_do_not_warn_again(tmp_path, capsys, monkeypatch):
    """The parent of a torchrun relaunch prints the config's warnings and marks the ranks' environment; rank 0 of
    those ranks (and any other rank) then stays silent, so each warning reaches the user once."""
    config = offline_job(tmp_path / "a")
    monkeypatch.setenv(WARNED_ENV, "1")
    assert main([str(config), "--train.steps=1", "--rollout.tasks_per_step=3"]) == 0
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    monkeypatch.delenv(WARNED_ENV)
    assert main([str(config), "--train.steps=1", "--rollout.tasks_per_step=3", "--checkpoint.resume=false"]) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]


def test_resuming_another_kind_of_job_is_one_error(tmp_path, capsys):
    """A checkpoint folder of an RL job given to an offline job (or the reverse) is refused by name, not a traceback
    from the other kind's step counters."""
    config = offline_job(tmp_path / "a")
    assert main([str(config), "--train.steps=1"]) == 0
    job_json = sorted((tmp_path / "a" / "ck").glob("step-*/job.json"))[-1]
    state = json.loads(job_json.read_text())
    assert state["job"]["job_kind"] == "offline"
    state["job"]["job_kind"] = "rl"
    job_json.write_text(json.dumps(state))
    capsys.readouterr()
    assert main([str(config), "--train.steps=2", "--resume"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    (message,) = [m for m in (out + err).splitlines() if m.startswith("error:")]
    assert "holds a checkpoint of a 'rl' job" in message and "`job.kind` = 'offline'" in message, message


def test_microbatches_the_cost_model_sends_flat_train_like_the_trie(tmp_path):
    """planner.mode = "auto" with a `[planner.cost]` that predicts flat execution free: a HARTS plan's microbatch
    whose expansion fits the capacity runs flat (logged as train/flat_microbatches, its rows the trajectories'
    tokens), and 3 steps end at the parameters the trie trains to (float64, 1e-9 relative per tensor: the same math
    in another summation order, through 3 AdamW steps)."""
    a, b = offline_job(tmp_path / "a"), offline_job(tmp_path / "b")
    # One tree a step (25-29 trie rows, 78-84 tokens): its expansion fits 90 rows.
    args = [*FLOAT64, "--train.steps=3", "--train.trees_per_step=1", "--planner.capacity=90"]
    assert main([str(a), *args]) == 0
    assert main([str(b), *args, "--planner.cost.expansion_per_token=0"]) == 0
    flat = {name: [e.value for e in events(tmp_path / name).Scalars("train/flat_microbatches")] for name in "ab"}
    rows = {name: [e.value for e in events(tmp_path / name).Scalars("train/compact_tokens")] for name in "ab"}
    tokens = [e.value for e in events(tmp_path / "b").Scalars("train/semantic_tokens")]
    assert flat == {"a": [0.0] * 3, "b": [1.0] * 3}
    assert rows["b"] == tokens and all(r < t for r, t in zip(rows["a"], tokens))
    trie, expanded = (Checkpointer(tmp_path / name / "ck").load()["model"] for name in "ab")
    assert trie.keys() == expanded.keys()
    for k in trie:  # measured: <= 2.6e-11 (GDN's in_proj_ba; Adam divides rounding by small second moments)
        assert (trie[k] - expanded[k]).norm() <= 1e-9 * trie[k].norm(), k
