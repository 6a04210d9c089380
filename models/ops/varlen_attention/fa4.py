"""Packed causal attention forward and backward as separate calls of FlashAttention-4's CuTe-DSL kernels (the
flash-attn-4 package, `flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd`; Hopper and Blackwell, bf16/fp16),
with the signatures, layouts and bottom-right causal convention of `naive.py` and `flash.py`. The log-sum-exp is
float32 `[H, Q]`, as flash's, and passes unchanged from the forward to the backward.

Value head dims: the kernels take a value head dim V of their own where their Hopper backward has one, i.e. V == K,
or MLA's (K, V) = (192, 128) without GQA (`native_values`; MLA's value work is then not padded, unlike flash's).
Other shapes failed in flash-attn-4 4.0.0b36 on the H200: GQA with V != K ("GQA backward requires head_dim ==
head_dim_v"), (64, 32) (a TMA layout error at compile time). For those the values are zero-padded to K inside the
pair, exactly as in `flash.py`, and the outputs cut back. flash-attn-4 is imported on first call: the package is
optional (`require_fa4`, checked by `kernels.check_cuda_attention`). The forward is a torch custom op, so selective
recomputation keeps its outputs as it keeps flash's (`models.recompute`)."""

from __future__ import annotations

import torch

from models.ops.varlen_attention.kernel_args import int32_offsets, pad_to

__all__ = ["fa4_varlen_forward", "fa4_varlen_backward", "fa4_interface", "native_values", "require_fa4"]

#: (K, V) pairs with V != K whose values the kernels take unpadded when q and k/v have equal heads.
NATIVE_MLA_DIMS = {(192, 128)}


def fa4_interface():
    """flash-attn-4's interface module; raises RuntimeError naming why it cannot be imported."""
    try:
        from flash_attn.cute import interface
    except Exception as e:  # not installed, or its CUDA libraries fail to load (OSError and the like)
        fix = "install the flash-attn-4 package"
        if isinstance(e, ModuleNotFoundError) and (e.name or "").startswith("cutlass"):
            fix = ("install nvidia-cutlass-dsl-libs-core too (the CuTe DSL's Python, a wheel of its own since "
                   "nvidia-cutlass-dsl 4.6)")
        raise RuntimeError(f"flash-attn-4 is not importable ({type(e).__name__}: {e}); {fix} or use the flash "
                           "kernels") from None
    return interface


def require_fa4() -> None:
    """Raises RuntimeError naming why the fa4 pair cannot run in this process: flash-attn-4 cannot be imported
    (`fa4_interface`), or the GPU is older than compute capability 9.0, where flash-attn-4 4.0.0b36's
    `_flash_attn_bwd` has no backward."""
    fa4_interface()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if major < 9:
            raise RuntimeError(f"FlashAttention-4's backward needs compute capability 9.0 or newer (Hopper, "
                               f"Blackwell); this GPU has {major}.{minor}: use the flash kernels")


def native_values(q_QHK: torch.Tensor, v_SGV: torch.Tensor) -> bool:
    """Whether the kernels run these values at their own head dim (else they are padded to q's)."""
    K, V = q_QHK.shape[-1], v_SGV.shape[-1]
    return K == V or (q_QHK.shape[1] == v_SGV.shape[1] and (K, V) in NATIVE_MLA_DIMS)


@torch.library.custom_op(
    "arbor::fa4_varlen_forward", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, int max_q, int max_k, float scale) -> "
           "(Tensor, Tensor)",
)
def fa4_varlen_forward(q_QHK: torch.Tensor, k_SGK: torch.Tensor, v_SGV: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out `[Q, H, V]`, lse `[H, Q]` float32).

    A torch custom op (`arbor::fa4_varlen_forward`, returning new tensors), so that activation recomputation's op
    policy sees the forward as one op and its "attention" group keeps out and lse instead of running the kernel
    again (`models.recompute.SAVE_GROUPS`), as it does for flash's `aten::_flash_attention_forward`."""
    V = v_SGV.shape[-1]
    v = v_SGV if native_values(q_QHK, v_SGV) else pad_to(v_SGV, q_QHK.shape[-1])
    out, lse, *_ = fa4_interface()._flash_attn_fwd(
        q_QHK, k_SGK, v, cu_seqlens_q=int32_offsets(cu_q), cu_seqlens_k=int32_offsets(cu_k), max_seqlen_q=max_q,
        max_seqlen_k=max_k, softmax_scale=scale, causal=True, return_lse=True,
    )
    return (out[..., :V].contiguous() if out.shape[-1] > V else out), lse


@fa4_varlen_forward.register_fake
def _(q_QHK, k_SGK, v_SGV, cu_q, cu_k, max_q, max_k, scale):
    Q, H = q_QHK.shape[:2]
    return q_QHK.new_empty(Q, H, v_SGV.shape[-1]), q_QHK.new_empty(H, Q, dtype=torch.float32)


def fa4_varlen_backward(dout_QHV, q_QHK, k_SGK, v_SGV, out_QHV, lse, cu_q, cu_k, max_q: int, max_k: int,
                        scale: float):
    """-> (dq `[Q, H, K]`, dk `[S, G, K]`, dv `[S, G, V]`)."""
    V = v_SGV.shape[-1]
    W = V if native_values(q_QHK, v_SGV) else q_QHK.shape[-1]
    dq, dk, dv = fa4_interface()._flash_attn_bwd(
        q_QHK, k_SGK, pad_to(v_SGV, W), pad_to(out_QHV, W), pad_to(dout_QHV, W).contiguous(), lse, scale, True,
        cu_seqlens_q=int32_offsets(cu_q), cu_seqlens_k=int32_offsets(cu_k), max_seqlen_q=max_q, max_seqlen_k=max_k,
    )
    return dq, dk, dv[..., :V]
