"""Which (forward, backward) kernel pair packed causal attention runs for a tensor: for CUDA bf16/fp16 tensors the
CUDA pair the caller names (a model's `KernelSettings.attention`: torch's varlen FlashAttention-2 by default; "auto",
the default of the RL job and the benchmarks, chooses FlashAttention-4 where it can run, `auto_cuda_attention`), the
plain-torch reference otherwise. Flat execution and the tree's branch views both ask here with their model's pair,
so they run the same kernels."""

import torch

from models.ops.varlen_attention.fa4 import fa4_varlen_backward, fa4_varlen_forward, native_values, require_fa4
from models.ops.varlen_attention.flash import flash_varlen_backward, flash_varlen_forward
from models.ops.varlen_attention.naive import naive_varlen_backward, naive_varlen_forward

#: The CUDA kernel pairs by name: flash (`flash.py`, FlashAttention-2 in torch) and fa4 (`fa4.py`, the optional
#: flash-attn-4 package).
CUDA_ATTENTION = {"flash": (flash_varlen_forward, flash_varlen_backward),
                  "fa4": (fa4_varlen_forward, fa4_varlen_backward)}
#: The choices of the RL job and the benchmarks: a pair, or "auto" (`auto_cuda_attention`).
ATTENTION_CHOICES = ("auto", *CUDA_ATTENTION)
#: (query/key head dim, value head dim, GQA) of the attention the fa4 pair passed its CUDA tests with on an H200
#: (`tests/models/ops/test_varlen_attention.py`, against the float64 reference; MLA's 192/128 and 96/64 also in
#: whole bf16 steps, bitwise tree against flat: bench/RESULTS.md, "GPU: bf16 fidelity", and docs/history.md). "auto"
#: takes fa4 for these only.
FA4_TESTED_SHAPES = frozenset({(64, 64, False), (64, 64, True), (192, 128, False), (192, 128, True), (96, 64, False),
                               (64, 32, False)})


def auto_cuda_attention(shapes=()) -> tuple[str, str]:
    """The pair "auto" means in this process for a model whose full-attention layers have `shapes` (`(K, V, GQA)`
    each, e.g. `{config.full_attention.attention_shape}`; none: no layer runs the kernels), and why: fa4 where
    `require_fa4` passes on a Hopper GPU (compute capability 9.x, where it was tested) and every shape is among
    `FA4_TESTED_SHAPES` (its kernels run a SWE step's attention faster than flash, with bf16 tree log-probs still
    bitwise equal to flat: bench/RESULTS.md, "GPU: attention kernels"); else flash, with what keeps fa4 out."""
    try:
        require_fa4()
    except RuntimeError as e:
        return "flash", str(e)
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        major, minor = torch.cuda.get_device_capability()
        return "flash", (f"FlashAttention-4 was tested on Hopper (compute capability 9.x) only; this GPU has "
                         f"{major}.{minor}: choose fa4 to run it anyway")
    untested = sorted(set(shapes) - FA4_TESTED_SHAPES)
    if untested:
        dims = ", ".join(f"{k}/{v}{' GQA' if gqa else ''}" for k, v, gqa in untested)
        return "flash", (f"FlashAttention-4 was not tested with this model's attention head dims {dims}: choose "
                         "fa4 to run it anyway")
    return "fa4", "flash-attn-4 can run here, on head dims it was tested with"


def check_cuda_attention(name: str) -> None:
    """Raises unless CUDA bf16/fp16 attention can run with pair `name` in this process: ValueError when `name` is not
    a pair of `CUDA_ATTENTION`; RuntimeError for fa4 where flash-attn-4 cannot be imported or the GPU is older than
    Hopper (the message says why). ("auto" is resolved by the caller, `auto_cuda_attention`, which needs the model's
    attention shapes.)"""
    if name not in CUDA_ATTENTION:
        raise ValueError(f"CUDA attention kernels are one of {', '.join(CUDA_ATTENTION)}, got {name!r}")
    if name == "fa4":
        require_fa4()


def varlen_kernels(x: torch.Tensor, pair: str = "flash"):
    """(forward, backward) for tensors like `x`: the CUDA pair `pair` (a name of `CUDA_ATTENTION`) where it runs."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return CUDA_ATTENTION[pair]
    return naive_varlen_forward, naive_varlen_backward


def pads_values(q_QHK: torch.Tensor, v_SGV: torch.Tensor, pair: str = "flash") -> bool:
    """Whether the kernel pair for these queries (`varlen_kernels(q_QHK, pair)`) runs these values at the query/key
    head dim K (flash always, fa4 unless `fa4.native_values`: a smaller V is zero-padded to K inside each call). A
    caller that gathers the values of many views from one tensor pads that tensor once instead
    (`models.tree.branch_attention`): padding each gathered view costs a copy of every view row."""
    if v_SGV.shape[-1] >= q_QHK.shape[-1]:
        return False
    forward = varlen_kernels(q_QHK, pair)[0]
    return forward is flash_varlen_forward or (forward is fa4_varlen_forward and not native_values(q_QHK, v_SGV))
