"""Round-wise linear attention with chunk-aligned replay reproduces trajectory-wise chunking exactly.

In float32 on the CPU reference, every chunk of an input sequence holds the same rows at the same offsets as in the
trajectory that ends at the sequence's last row, so the sequence's core outputs are bitwise equal to running that
trajectory alone. (Another trajectory through a shared row may see other rows later in the same chunk; the chunkwise
kernel's rounding for a row can depend on them, so trajectory-wise training itself gives such a row slightly
different values in different trajectories — tree execution reproduces one of them.) The no-replay ablation
(parent state handed over at the fork) re-partitions chunks: mathematically equal, numerically different — this
test shows the difference is real, so the exactness check can fail.
"""

import numpy as np
import pytest
import torch

from bench.branching import nested_fork_trajectories
from models.linear_attention import CoreInputs
from models.tree.layout import TreeLayout
from models.tree.mixers import linear_attention_states, read_rows
from planner.calls.plan import plan_calls
from planner.pack import pack
from tests.models.tree.test_execute import make_model


def random_core_inputs(model, C, dtype, seed):
    lin = model.config.linear_attention
    g = torch.Generator().manual_seed(seed)
    H = getattr(lin, "num_k_heads", getattr(lin, "num_heads", None))
    HV = getattr(lin, "num_v_heads", H)
    K = getattr(lin, "head_k_dim", getattr(lin, "head_dim", None))
    V = getattr(lin, "head_v_dim", K)
    q = torch.nn.functional.normalize(torch.randn(C, H, K, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(C, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(C, HV, V, generator=g, dtype=dtype)
    gshape = (C, HV, K) if model.config.family == "kimi_linear" else (C, HV)
    decay = -torch.rand(gshape, generator=g, dtype=dtype) * 0.1
    beta = torch.rand(C, HV, generator=g, dtype=dtype)
    return CoreInputs(q, k, v, decay, beta)


def per_trajectory(mixer, inputs_c, batch):
    """{last compact row of trajectory: core outputs [L, HV, V] of that trajectory run alone}."""
    outs = {}
    for i in range(batch.num_trajectories):
        rows = torch.as_tensor(batch.sem_to_compact[batch.traj_offsets[i] : batch.traj_offsets[i + 1]])
        sub = CoreInputs(*(t[rows] for t in (inputs_c.q, inputs_c.k, inputs_c.v, inputs_c.g, inputs_c.beta)))
        o, _ = mixer.core(sub, torch.tensor([0, rows.numel()]))
        outs[int(rows[-1])] = o
    return outs


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_replay_is_bitwise_and_no_replay_is_not(name):
    model = make_model(name, torch.float32)
    mixer = next(layer.mixer for layer in model.model.layers if layer.layer_type == "linear_attention")
    chunk = mixer.chunk_size
    batch = pack(nested_fork_trajectories(np.random.default_rng(3), chunk, 50, depth=5))
    inputs_c = random_core_inputs(model, batch.num_compact, torch.float32, seed=1)
    flat = per_trajectory(mixer, inputs_c, batch)
    diffs = {}
    for replay in (True, False):
        plan = plan_calls(batch, chunk, replay=replay)
        layout = TreeLayout.build(batch, plan, model.config.linear_attention.conv_size)
        p2c = torch.as_tensor(plan.physical_to_compact)
        inputs_p = CoreInputs(*(t[p2c] for t in (inputs_c.q, inputs_c.k, inputs_c.v, inputs_c.g, inputs_c.beta)))
        on_calls = CoreInputs(*(read_rows(t, layout.mixer_rows) for t in vars(inputs_p).values()))
        o_p = read_rows(linear_attention_states(mixer, on_calls, layout)[0], layout.linear_keep)
        worst = 0.0
        for n in range(plan.seq_row_offsets.size - 1):
            lo, hi = plan.seq_row_offsets[n], plan.seq_row_offsets[n + 1]
            last = int(plan.physical_to_compact[hi - 1])
            if last not in flat:  # the sequence ends where no trajectory ends (a prefix of a longer path)
                continue
            positions = torch.as_tensor(batch.positions[plan.physical_to_compact[lo:hi]])
            worst = max(worst, (o_p[lo:hi] - flat[last][positions]).abs().max().item())
        diffs[replay] = worst
    assert diffs[True] == 0.0, diffs
    assert diffs[False] > 1e-7, diffs
