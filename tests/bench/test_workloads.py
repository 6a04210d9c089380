"""bench.workloads: seeded, documented shapes, compact size = sum of branch lengths, TRAJ.jsonl output."""

import numpy as np
import pytest

from bench.workloads import main, swe_like_step, tau2_like_step
from planner.jsonl import read_jsonl
from planner.lcp_index import LcpIndex
from planner.pack import pack


@pytest.mark.parametrize("make", [swe_like_step, tau2_like_step])
def test_seeded_and_bounded(make):
    a = make(5, scale=0.05, token_scale=0.05, vocab_size=1000)
    b = make(5, scale=0.05, token_scale=0.05, vocab_size=1000)
    c = make(6, scale=0.05, token_scale=0.05, vocab_size=1000)
    assert [t.tokens.tolist() for t in a] == [t.tokens.tolist() for t in b]
    assert [t.tokens.tolist() for t in a] != [t.tokens.tolist() for t in c]
    limit = round((65_536 if make is swe_like_step else 16_384) * 0.05)
    assert max(len(t) for t in a) <= limit
    assert all(t.tokens.min() >= 0 and t.tokens.max() < 1000 for t in a)
    assert all(t.tree is not None for t in a)
    assert len({tuple(t.tokens.tolist()) for t in a}) == len(a)  # siblings start with distinct tokens


def test_swe_shape_scaled():
    trajectories = swe_like_step(1, scale=0.1, token_scale=0.1)
    batch = pack(trajectories)
    assert 100 <= len(trajectories) <= 400
    assert 4.0 < batch.compression < 12.0
    assert batch.max_depth <= 6554
    # Trees share exactly the template root (3 tokens, 1 after token_scale=0.1) with each other.
    index = LcpIndex.from_trajectories(trajectories)
    trees = np.array([t.tree for t in trajectories])[index.order]
    between = trees[1:] != trees[:-1]
    assert len(set(trees)) > 1 and set(index.lcp[1:][between].tolist()) == {1} and index.lcp[1:].min() == 1


def test_tau2_compression():
    trajectories = tau2_like_step(0, scale=0.2)
    batch = pack(trajectories)
    leaves = [t for t in trajectories if not any(
        len(u) > len(t) and np.array_equal(u.tokens[: len(t)], t.tokens) for u in trajectories if u.tree == t.tree)]
    leaf_batch = pack(leaves)
    assert 8.5 < batch.compression < 10.5  # AReaL-DTA: 9.43x
    assert 5.0 < leaf_batch.num_semantic / leaf_batch.num_compact < 6.2  # 5.56x counting leaves only
    assert batch.num_compact == leaf_batch.num_compact


def test_main_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["swe", "--seed", "2", "--scale", "0.02", "--token-scale", "0.02", "--out", str(out)]) == 0
    back = read_jsonl(out)
    made = swe_like_step(2, scale=0.02, token_scale=0.02)
    assert [t.tokens.tolist() for t in back] == [t.tokens.tolist() for t in made]
    assert f"wrote {len(made)} trajectories" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [({"scale": 0}, "`scale` must be > 0"),
                                              ({"token_scale": -1}, "`token_scale` must be > 0"),
                                              ({"vocab_size": 1}, "`vocab_size` must lie in")])
def test_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        swe_like_step(0, **kwargs)
