"""Plain-torch depthwise short causal convolution with per-sequence context, in fla's state convention.

Legend: B batch rows, T tokens, N sequences, D channels, W kernel width.

State `[N, D, W]` (fla `causal_conv1d`): slot W-1 holds the most recent input, slots 1..W-1 the last W-1 inputs;
slot 0 is padding that the forward never reads. The final state is the last W inputs of
[initial_state slots, the sequence's rows]; fla drops the gradient of final-state slot 0, and so does this reference.
"""

import torch
import torch.nn.functional as F

CONV_ACTIVATIONS = (None, "silu", "swish")


def _sequence_bounds(batch: int, tokens: int, cu_seqlens: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """Flat (row-major over `[B, T]`) start and end of every sequence."""
    if cu_seqlens is None:
        return [b * tokens for b in range(batch)], [(b + 1) * tokens for b in range(batch)]
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError("`cu_seqlens` must be a 1-D int32/int64 tensor [N+1] of cumulative sequence lengths")
    if batch != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (pack sequences along T), got B={batch}")
    bounds = cu_seqlens.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != tokens or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"`cu_seqlens` must be non-decreasing from 0 to T={tokens}, got {bounds}")
    return bounds[:-1], bounds[1:]


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y[t] = act(bias + sum_j weight[:, j] * x[t - (W-1) + j]) over each sequence's own rows, preceded by
    `initial_state[i, :, 1:]` as its W-1 rows of history (zeros if None); a packed neighbour is never history.

    Args:
        x: `[B, T, D]`.
        weight: `[D, W]` (`nn.Conv1d` depthwise weight `[D, 1, W]` squeezed).
        bias: `[D]` or None.
        initial_state: `[N, D, W]` per-sequence history (differentiable), None = zeros.
        output_final_state: return the `[N, D, W]` state after each sequence.
        activation: None, "silu" or "swish".
        cu_seqlens: LongTensor `[N+1]` packing N sequences along T (B must be 1); None = each row is a sequence.

    Returns: y `[B, T, D]` in x.dtype (computed in fp32, float64 for float64 inputs),
    final_state `[N, D, W]` in x.dtype or None.

    Every output row is an elementwise function of its W input rows and is the same in any packing up to the last
    ulp: before the activation exactly, after silu up to torch's SIMD-body vs scalar-tail difference of exp.
    """
    if x.dim() != 3:
        raise ValueError(f"`x` must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"`weight` must be [D, W] with D={D}, got {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"`bias` must be [D] with D={D}, got {tuple(bias.shape)}")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    starts, ends = _sequence_bounds(B, T, cu_seqlens)
    N = len(starts)
    if initial_state is not None and tuple(initial_state.shape) != (N, D, W):
        raise ValueError(
            f"`initial_state` must have shape {[N, D, W]} (N = sequences), got {tuple(initial_state.shape)}"
        )

    dtype = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
    device = x.device
    x_flat = x.reshape(B * T, D)
    if initial_state is None:
        initial_state = x.new_zeros(N, D, W)
    # Rows B*T + i*W + s of `rows` hold slot s of sequence i's initial state, so history is a plain gather.
    rows = torch.cat([x_flat, initial_state.transpose(1, 2).reshape(N * W, D).to(x.dtype)])
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], device=device)
    seq_of_row = torch.repeat_interleave(torch.arange(N, device=device), lengths)  # [B*T]
    start_of_row = torch.tensor(starts, device=device)[seq_of_row]
    flat_pos = torch.arange(B * T, device=device)

    def source(pos: torch.Tensor, seq: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Index into `rows` of flat position `pos` of sequence `seq`, reading the initial state before `start`."""
        return torch.where(pos >= start, pos, B * T + seq * W + W + pos - start)

    rows_c = rows.to(dtype)
    weight_c = weight.to(dtype)
    y = None
    for j in range(W):
        x_j = rows_c[source(flat_pos - (W - 1) + j, seq_of_row, start_of_row)]
        y = weight_c[:, j] * x_j if y is None else y + weight_c[:, j] * x_j
    if bias is not None:
        y = y + bias.to(dtype)
    if activation is not None:
        y = F.silu(y)
    y = y.to(x.dtype).reshape(B, T, D)

    final_state = None
    if output_final_state:
        seq = torch.arange(N, device=device)
        start = torch.tensor(starts, device=device)
        end = torch.tensor(ends, device=device)
        slot_pos = end[:, None] - W + torch.arange(W, device=device)  # [N, W]
        final_state = rows[source(slot_pos, seq[:, None], start[:, None])].transpose(1, 2)  # [N, D, W]
        final_state = torch.cat([final_state[..., :1].detach(), final_state[..., 1:]], dim=-1)
    return y, final_state
