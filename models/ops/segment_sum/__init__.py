"""Adding sums of source rows to target rows, the summation planned on the host: `add_segment_sums` runs the Triton
`fused_add_segment_sums` on CUDA and `naive_add_segment_sums` otherwise (float64 included).

It is the gradient of a row gather whose index repeats rows (tree execution's branch views read a trunk row once
per branch): torch's `index_put_(accumulate=True)` sorts the index on the device at every call and
`index_add_` serialises its atomic adds on a repeated row; here the order is a `SegmentPlan` built once per layout.
"""

from models.ops.dispatch import use_fla
from models.ops.segment_sum.naive import naive_add_segment_sums
from models.ops.segment_sum.plan import SegmentPlan


def add_segment_sums(out, src, plan: SegmentPlan) -> None:
    """Signature of `models.ops.segment_sum.naive.naive_add_segment_sums` (in place on `out`)."""
    if use_fla(src):
        from models.ops.segment_sum.fused import fused_add_segment_sums

        fused_add_segment_sums(out, src, plan)
    else:
        naive_add_segment_sums(out, src, plan)


__all__ = ["SegmentPlan", "add_segment_sums", "naive_add_segment_sums"]
