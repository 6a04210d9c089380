"""The offline job (app/offline_job.py) on two pipeline stages (`parallel.pp` = 2, 1F1B, 2 gloo ranks; torch >= 2.14)
equals the job in one process: the same records, per-step losses and entropies, and exported weights (float64: the
runs differ only in summation order, TOL as in tests/app/test_distributed.py), and --resume moves a run through its
DCP checkpoints from the two stages to one process and from one process to the two stages."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.__main__ import main
from models.hf_io import load_hf
from tests.app.test_distributed import TOL, launch, scalars
from tests.app.test_offline_job import FLOAT64, offline_job

#: Two updates a step (the stages also score the old log-probs), 4 steps of 2 trees over an epoch of 8 trees, at
#: least 2 microbatches a step (1F1B needs pp; at the job's capacity of 48 rows a step can fit one).
JOB = [*FLOAT64, "--rl.epochs=2", "--train.steps=4", "--planner.capacity=24"]
PP = ["--parallel.pp=2"]
#: Equal to TOL (relative): the losses, entropies, gradient norms and log-prob gaps to the records; exactly: the
#: records read. (Microbatches and compact rows differ: pp > 1 plans duplicate microbatches, one process the trie.)
LOSSES = ("train/loss", "train/policy_loss", "train/entropy", "train/grad_norm", "mismatch/abs_mean")
COUNTS = ("data/records", "data/epoch", "train/semantic_tokens")


def assert_same_run(got: Path, want: Path) -> None:
    """Every offline step of `got` read the records of `want`'s and reached its losses, and the HF exports hold the
    same weights."""
    for tag in COUNTS:
        assert scalars(got, tag) == scalars(want, tag), tag
    for tag in LOSSES:
        a, b = scalars(got, tag), scalars(want, tag)
        assert a.keys() == b.keys() == {1, 2, 3, 4}, tag
        for step in a:
            assert abs(a[step] - b[step]) <= TOL * max(abs(b[step]), 1e-3), (tag, step, a[step], b[step])
    a, b = load_hf(got / "hf").state_dict(), load_hf(want / "hf").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        err = (a[name] - b[name]).abs().max().item() / b[name].abs().max().item()
        assert err <= TOL, (name, err)


@pytest.mark.pipeline
@pytest.mark.parametrize("first", ["pp2", "one"], ids=["pp2-then-one-process", "one-process-then-pp2"])
def test_two_pipeline_stages_resumed_across_layouts_equal_one_process(tmp_path, first):
    """Steps 1-2 in the layout `first`, checkpointed, steps 3-4 resumed in the other one; the exported policy of a
    pp = 2 run is gathered from both stages on rank 0."""
    want = offline_job(tmp_path / "want").parent
    assert main([str(want / "job.toml"), *JOB]) == 0
    got = offline_job(tmp_path / "got").parent
    if first == "pp2":
        launch(got, 2, *JOB, *PP, "--train.steps=2")
        assert main([str(got / "job.toml"), *JOB, "--resume"]) == 0
    else:
        assert main([str(got / "job.toml"), *JOB, "--train.steps=2"]) == 0
        out = launch(got, 2, *JOB, *PP, "--resume")
        assert "resumed from" in out and "offline step   4/4" in out and "exported the policy" in out
    assert (got / "ck" / "step-2" / ".metadata").is_file()
    assert_same_run(got, want)
