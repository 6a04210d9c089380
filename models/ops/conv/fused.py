"""fla fast path for the short causal convolution (CUDA): `fla.modules.causal_conv1d.causal_conv1d`, Triton backend.

Legend: B batch rows, T tokens, N sequences, D channels, W kernel width.
Reference with the same signature and state convention: `models.ops.conv.naive.naive_causal_conv1d`.
"""

import torch

from models.ops.conv.naive import CONV_ACTIVATIONS


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Arguments and returns as `naive_causal_conv1d`: x `[B, T, D]`, weight `[D, W]`, initial_state `[N, D, W]`
    (cast to x.dtype), y `[B, T, D]` and final_state `[N, D, W]` in x.dtype. fla is imported here (slow import)."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (pack sequences along T), got B={x.shape[0]}")
    return fla_causal_conv1d(
        x,
        weight=weight,
        bias=bias,
        initial_state=None if initial_state is None else initial_state.to(x.dtype),
        output_final_state=output_final_state,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens,
    )
