"""Layer calls for the KDA calls' tests (`test_kda_calls.py`, and `chains_interpreted.py` under Triton's interpreter):
rounds of three sequences cut into pieces, as `models.tree.core_calls` cuts them."""

import numpy as np

from models.tree.core_calls import CoreCall
from planner.index_arrays import offsets

B = 64
# A round of three sequences, as (start, end) rows of each sequence's pieces:
ROUNDS = {
    # 333 rows cut at chunks 2 and 4, 192 rows cut at chunk 1, 40 rows uncut: later calls drop sequences.
    "dropping": [[(0, 128), (128, 256), (256, 333)], [(0, 64), (64, 192)], [(0, 40)]],
    # every sequence cut once, the second piece one row or several chunks: the calls keep all sequences.
    "continuing": [[(0, 128), (128, 200)], [(0, 64), (64, 65)], [(0, 192), (192, 400)]],
    # nothing cut: one call.
    "single call": [[(0, 100)], [(0, 64)], [(0, 7)]],
}
SIDE_ROWS = (70, 5)  # a later round's two sequences, both starting from the first sequence's state after chunk 2


def layer_calls(pieces, outside: bool = True, side: bool = True) -> list[CoreCall]:
    """Call j packs piece j of each sequence; rows numbered sequence after sequence, table indices as in
    `models.tree.core_calls` (call 0 from entries 1..3, or from zeros without `outside`; later calls from the
    previous call's finals), then with `side` one call of a second round whose two sequences start from one entry:
    the first sequence's state at the end of its first piece."""
    starts = offsets([p[-1][1] for p in pieces])[:-1]
    table = 4 if outside else 1
    calls = []
    for j in range(max(len(p) for p in pieces)):
        seqs = [s for s, p in enumerate(pieces) if len(p) > j]
        rows = [np.arange(starts[s] + pieces[s][j][0], starts[s] + pieces[s][j][1]) for s in seqs]
        init = (np.array([1, 2, 3]) if outside else np.zeros(3, dtype=np.int64)) if j == 0 else \
            calls[-1].first_state + np.searchsorted(calls[-1].sequence, seqs)
        gather = np.concatenate(rows)
        calls.append(CoreCall(gather=gather, cu_seqlens=offsets([r.size for r in rows]), init_state=init,
                              output_pos=np.arange(gather.size), round=0, sequence=np.array(seqs), first_state=table))
        table += len(seqs)
    if not side:
        return calls
    first = calls[0].first_state
    side = np.arange(sum(SIDE_ROWS)) % calls[0].gather.size
    calls.append(CoreCall(gather=side, cu_seqlens=offsets(SIDE_ROWS), init_state=np.array([first, first]),
                          output_pos=np.arange(side.size), round=1, sequence=np.arange(2), first_state=table))
    return calls


def chained_side_calls(pieces, outside: bool = True) -> list[CoreCall]:
    """`layer_calls(pieces, outside, side=False)`, then a second round of two calls: three sequences, the first two
    starting from one entry (the first sequence's state after its first piece), the third from zeros; the first cut
    after one chunk, so the round's first call packs three pieces and its second call that sequence's second piece."""
    calls = layer_calls(pieces, outside, side=False)
    first, table = calls[0].first_state, calls[-1].first_state + calls[-1].num_sequences
    lengths = (B, 5, 40)
    rows = np.arange(sum(lengths) + 6) % calls[0].gather.size
    calls.append(CoreCall(gather=rows[: sum(lengths)], cu_seqlens=offsets(lengths),
                          init_state=np.array([first, first, 0]), output_pos=np.arange(sum(lengths)), round=1,
                          sequence=np.arange(3), first_state=table))
    calls.append(CoreCall(gather=rows[sum(lengths):], cu_seqlens=offsets([6]), init_state=np.array([table]),
                          output_pos=np.arange(6), round=1, sequence=np.array([0]), first_state=table + 3))
    return calls
