"""Plain-torch gated linear units: SwiGLU's silu(gate) * up and the sigmoid output gate sigmoid(gate) * x.

Legend: ... any shape (both arguments the same), elementwise.
"""

import torch
import torch.nn.functional as F


def naive_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up -> same shape and dtype; in bf16 two roundings (after silu, after the product), as
    transformers' `act_fn(gate_proj(x)) * up_proj(x)`."""
    return F.silu(gate) * up


def naive_sigmoid_gate(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) -> same shape and dtype; in bf16 two roundings (after sigmoid, after the product), as
    transformers' `attn_output * torch.sigmoid(gate)`."""
    return x * torch.sigmoid(gate)
