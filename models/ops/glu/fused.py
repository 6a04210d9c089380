"""fla fast paths for the gated linear units (CUDA): `fla.modules.activations` `swiglu` and `sigmoidglu`.

References with the same signatures: `models.ops.glu.naive`. The kernels are elementwise over the flattened
tensor (no reduction), so a row's result never depends on the other rows of the call. They compute in fp32 from
the loaded values and round once (the references round twice in bf16: after the activation and after the
product); backward recomputes the activation from the saved inputs, also in fp32 with one rounding per gradient.
Not traced by torch.compile (`parallel.config.compile`): the kernels are the fusion. fla is imported here (slow
import).
"""

import torch


def check(gate: torch.Tensor, other: torch.Tensor) -> None:
    if gate.shape != other.shape or gate.dtype != other.dtype:
        raise ValueError(
            f"`gate` {tuple(gate.shape)} {gate.dtype} and its partner {tuple(other.shape)} {other.dtype} must have "
            "one shape and dtype"
        )


@torch.compiler.disable
def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """As `naive_swiglu`; row-strided views (the halves of a fused gate|up projection) are read without a copy."""
    from fla.modules.activations import swiglu

    check(gate, up)
    return swiglu(gate, up)


@torch.compiler.disable
def fused_sigmoid_gate(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """As `naive_sigmoid_gate`."""
    from fla.modules.activations import sigmoidglu

    check(gate, x)
    return sigmoidglu(gate, x)
