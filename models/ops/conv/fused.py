"""Fast path for the short causal convolution (CUDA): own Triton kernels (`kernels.py`) forward and backward, and
fla's `causal_conv1d` when a final state is asked for.

Legend: B batch rows, T tokens, N sequences, D channels, W kernel width, NB row tiles.
Reference with the same signature and state convention: `models.ops.conv.naive.naive_causal_conv1d`.

Why own kernels: fla 0.6.0 runs one program per 64-row chunk of each sequence (a rollout tree's short segments
leave most of a chunk idle), its backward runs the forward again to recompute the pre-activation and writes the
weight gradient per chunk with a stride of W floats, and its chunk indices cost a host synchronisation per new
`cu_seqlens`. On ling-3-tiny's 60,664-row flat microbatch on the H200 its backward took 1.05 ms per 2,048-channel
call against a memory floor of about 0.3 ms (bench/RESULTS.md, session 18). Here a tile covers packed rows of any
sequences, backward recomputes the pre-activation inside the tile and reads x and dy once from memory, and nothing
waits for the host. A final state (training never asks for one) still goes through fla.

Rounding: the pre-activation is summed in fp32 in the order j = 0..W-1 and the bias added last, then silu in fp32,
one rounding to x.dtype (the reference rounds the same way from fp32). Backward: dx in fp32, one rounding; the weight
and bias gradients in fp32 per tile, summed over tiles in fp32, one rounding to the weight's dtype.
"""

import torch

from models.ops.conv.naive import CONV_ACTIVATIONS


def _packed(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[B, T, D]` as `[B T, D]` rows with the last dim contiguous (a column slice stays a view), and `cu_seqlens`
    (each batch row a sequence when None)."""
    B, T, D = x.shape
    rows = x[0] if B == 1 else x.reshape(B * T, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * T, T, device=x.device)
    return rows, cu_seqlens


def _strides(h0: torch.Tensor | None) -> tuple[int, int, int]:
    """The initial state's strides of sequences, channels and slots (any layout: the tree's is a transposed view)."""
    return (0, 0, 0) if h0 is None else h0.stride()


class ShortConvFunction(torch.autograd.Function):
    """Packed rows x `[T, D]` (last dim contiguous), weight `[D, W]`, bias `[D]` or None, initial_state `[N, D, W]`
    or None, cu_seqlens `[N+1]` -> y `[T, D]`; trusts `causal_conv1d`'s checks."""

    @staticmethod
    def forward(ctx, x_TD, weight_DW, bias_D, initial_state, cu_seqlens, silu: bool):
        import triton

        from models.ops.conv import kernels

        T, D = x_TD.shape
        W = weight_DW.shape[1]
        rows_T = torch.arange(T, device=x_TD.device, dtype=cu_seqlens.dtype)
        seq_T = torch.searchsorted(cu_seqlens[1:], rows_T, right=True).to(torch.int32)
        h0 = None if initial_state is None else initial_state.to(x_TD.dtype)
        y_TD = torch.empty(T, D, device=x_TD.device, dtype=x_TD.dtype)
        if T:
            grid = (triton.cdiv(T, kernels.FWD_BT), triton.cdiv(D, kernels.FWD_BD))
            kernels.short_conv_fwd_kernel[grid](
                x_TD, weight_DW, bias_D, h0, seq_T, cu_seqlens, y_TD, T, x_TD.stride(0), *_strides(h0), D=D, W=W,
                BT=kernels.FWD_BT, BD=kernels.FWD_BD, HAS_BIAS=bias_D is not None, HAS_H0=h0 is not None, SILU=silu,
                num_warps=kernels.FWD_WARPS,
            )
        ctx.save_for_backward(x_TD, weight_DW, bias_D, h0, seq_T, cu_seqlens)
        ctx.silu, ctx.state_dtype = silu, None if initial_state is None else initial_state.dtype
        return y_TD

    @staticmethod
    def backward(ctx, dy_TD):
        import triton

        from models.ops.conv import kernels

        x_TD, weight_DW, bias_D, h0, seq_T, cu_seqlens = ctx.saved_tensors
        T, D = x_TD.shape
        W = weight_DW.shape[1]
        if dy_TD.stride(-1) != 1:
            dy_TD = dy_TD.contiguous()
        NB = triton.cdiv(T, kernels.BWD_BT)
        dx_TD = torch.empty(T, D, device=x_TD.device, dtype=x_TD.dtype)
        dw_NWD = torch.empty(NB, W, D, device=x_TD.device, dtype=torch.float32)
        db_ND = None if bias_D is None else torch.empty(NB, D, device=x_TD.device, dtype=torch.float32)
        N = cu_seqlens.numel() - 1
        dz_head = None if h0 is None else torch.zeros(N, W - 1, D, device=x_TD.device, dtype=torch.float32)
        if T:
            kernels.short_conv_bwd_kernel[(NB, triton.cdiv(D, kernels.BWD_BD))](
                x_TD, weight_DW, bias_D, h0, seq_T, cu_seqlens, dy_TD, dx_TD, dw_NWD, db_ND, dz_head, T,
                x_TD.stride(0), *_strides(h0), dy_TD.stride(0), D=D, W=W,
                BW=triton.next_power_of_2(W), BT=kernels.BWD_BT, BD=kernels.BWD_BD, HAS_BIAS=bias_D is not None,
                HAS_H0=h0 is not None, SILU=ctx.silu, num_warps=kernels.BWD_WARPS,
            )
        dw = dw_NWD.sum(0).t().to(weight_DW.dtype)
        db = None if bias_D is None else db_ND.sum(0).to(bias_D.dtype)
        dh0 = None
        if h0 is not None:
            # Slot s (1..W-1) of sequence n feeds rows p = 0..s-1 through weight column s-1-p; slot 0 feeds none.
            w_DW = weight_DW.float()
            slots = [torch.zeros(N, D, device=x_TD.device, dtype=torch.float32)]
            for s in range(1, W):
                slots.append(sum(dz_head[:, p] * w_DW[:, s - 1 - p] for p in range(s)))
            dh0 = torch.stack(slots, dim=-1).to(ctx.state_dtype)
        return dx_TD, dw, db, dh0, None, None


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
    (cast to x.dtype), y `[B, T, D]` and final_state `[N, D, W]` in x.dtype or None."""
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"with `cu_seqlens` the batch size must be 1 (pack sequences along T), got B={x.shape[0]}")
    if output_final_state:
        return _fla_causal_conv1d(x, weight, bias, initial_state, activation, cu_seqlens)
    rows, cu = _packed(x, cu_seqlens)
    y = ShortConvFunction.apply(rows, weight.contiguous(), bias, initial_state, cu, activation is not None)
    return y.view(x.shape), None


def _fla_causal_conv1d(x, weight, bias, initial_state, activation, cu_seqlens):
    """fla's `causal_conv1d` (Triton backend), which also returns the final state. fla is imported here (slow)."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    return fla_causal_conv1d(
        x,
        weight=weight,
        bias=bias,
        initial_state=None if initial_state is None else initial_state.to(x.dtype),
        output_final_state=True,
        activation=activation,
        backend="triton",
        cu_seqlens=cu_seqlens,
    )
