"""HSDP + expert parallelism on 4 CPU ranks (gloo), float64: dp_replicate 2 x dp_shard 2, routed experts split over
ep 2 (all-to-all of compact rows), sharded over efsdp 1 and replicated over dp_replicate. Kimi-Linear's sigmoid
router with expert bias and seq-mean-token-mean aggregation; loss and gradients equal the single-process step's."""

from tests.parallel.harness import compare_step, run_ranks


def test_hsdp_ep_step_matches_single_process():
    run_ranks(4, compare_step, "tiny-kimi-linear", {"dp_replicate": 2, "ep": 2}, 192, 2, "none", 4,
              "seq-mean-token-mean")
