"""FSDP2 + tensor parallelism on CPU ranks (gloo), float64: head-sharded GDN (fused qkvz / ba layouts) with gated
attention, and KDA with MLA; width-sharded dense and shared-expert MLPs; vocabulary-parallel embeddings and
compact log-probs. The step's loss and every gradient equal the single-process step's."""

import pytest

from tests.parallel.harness import compare_step, run_ranks

#: Compact rows per microbatch: at least 2 microbatches per replica (KDA chunks of 32 make longer paths).
CAPACITY = {"tiny-qwen3-next": 128, "tiny-kimi-linear": 192}


@pytest.mark.parametrize(
    "preset_name, world_size, parallel",
    [
        ("tiny-qwen3-next", 4, {"tp": 2}),  # dp_shard 2 x tp 2
        ("tiny-kimi-linear", 2, {"tp": 2}),  # dp_shard 1 x tp 2, with activation recomputation
    ],
    ids=["gdn-dp2-tp2", "kda-mla-tp2-ac"],
)
def test_fsdp_tp_step_matches_single_process(preset_name, world_size, parallel):
    recompute = "full" if preset_name == "tiny-kimi-linear" else "none"
    run_ranks(world_size, compare_step, preset_name, parallel, CAPACITY[preset_name], 2, recompute)
