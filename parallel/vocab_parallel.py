"""Vocabulary-parallel compact log-probabilities: `models.logprobs.compact_logprobs` with an LM head sharded over tp.

Legend: C compact rows, D model dim, V vocabulary, Vl = V / t rows of the LM head on this rank, P predicted positions,
S semantic positions.

Rank r holds the LM-head rows [vocab_start, vocab_start + Vl). The chunked forward and recomputing backward are
`models.logprobs.sharded_compact_logprobs`; this module supplies its `VocabShards`: the rank's rows of each target
id, and the reductions of per-row and per-prediction scalars as all-reduces over the tp group. The hidden-state
gradient is a sum over ranks, applied by the caller's f (`copy_to_group`) before this function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.logprobs import VocabShards, sharded_compact_logprobs

__all__ = ["GroupVocabShards", "vocab_parallel_compact_logprobs"]


class GroupVocabShards(VocabShards):
    """Equal contiguous vocabulary shards over the ranks of `group`; this rank's starts at id `vocab_start`."""

    def __init__(self, vocab_start: int, group: dist.ProcessGroup):
        self.vocab_start = vocab_start
        self.group = group

    def vocab_size(self, shard_rows: int) -> int:
        return shard_rows * dist.get_world_size(self.group)

    def local_targets(self, target_P: torch.Tensor, shard_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        local_P = target_P - self.vocab_start
        held_P = (local_P >= 0) & (local_P < shard_rows)
        return local_P.clamp(0, shard_rows - 1), held_P

    def max_(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)

    def sum_(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)


def vocab_parallel_compact_logprobs(
    hidden_CD, weight_VD, logit_row_S, target_S, *, vocab_start, group, chunk_rows=None, entropy=False, fused=True
):
    """`models.logprobs.compact_logprobs` with the LM head split by vocabulary over `group`.

    Args:
        hidden_CD: [C, D] final hidden states, the same on every rank of `group`; wrap it in
            `parallel.collectives.copy_to_group` first so its gradient is summed over the group.
        weight_VD: [Vl, D] this rank's LM-head rows (vocabulary ids [vocab_start, vocab_start + Vl)).
        logit_row_S, target_S: [S] int64 as in `compact_logprobs` (-1 rows predict nothing; targets are global ids).
        vocab_start: first vocabulary id of this rank's shard.
        group: the tensor-parallel process group.
        chunk_rows: rows per chunk of [rows, Vl] logits, as in `models.logprobs.compact_logprobs` (default: fp32
            scratch near 512 MiB, at most 4,096 rows; on CUDA every chunk has exactly this many).
        entropy: also return the entropy of each position's predictive distribution (over the whole vocabulary).
        fused: the vocabulary passes on their fused kernels where they run (as in `compact_logprobs`).
    Returns: logprobs [S] (fp32, or fp64 for fp64 inputs), and entropy [S] if requested; identical on all ranks.
    Reference: `models.logprobs.compact_logprobs` on the gathered LM head.
    """
    return sharded_compact_logprobs(
        hidden_CD, weight_VD, logit_row_S, target_S, GroupVocabShards(int(vocab_start), group),
        chunk_rows=chunk_rows, entropy=entropy, fused=fused,
    )
