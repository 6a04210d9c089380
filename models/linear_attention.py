"""Shared skeleton of the chunkwise linear-attention mixers (GDN, KDA), split into steps for tree execution.

Legend: T tokens, D model dim, C conv channels (q|k|v), W conv width, N packed sequences, H query/key heads,
HV value heads, K/V key/value head dims.

Steps (1, 3 and 5 are pure functions of their row; 2 and 4 couple the rows of one packed sequence):
  1. `project(x)`        per-row projections: q|k|v before the conv, raw gate inputs            -> mixer's `Rows`
  2. `conv(qkv, ...)`    short causal depthwise conv + silu per packed sequence, with optional
                         per-sequence initial conv states                          -> q, k, v `[T, C_q|C_k|C_v]`
  3. `activate(rows, qkv_conv)`  per-row: split heads, L2-normalise q and k, activate the decay
                         g (log space, fp32) and beta (sigmoid)                                 -> `CoreInputs`
  4. `core(inputs, ...)` chunkwise delta rule per packed sequence (models.ops), with initial and
                         final states passed through                                            -> `[T, HV, V]`
  5. `output(o, rows)`   per-row gated RMSNorm and output projection                            -> `[T, D]`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.dtypes import upcast
from models.ops import short_conv
from models.ops.conv.recomputed_rows import RecomputedRows, conv_recomputed_rows
from models.ops.dispatch import use_fla
from models.ops.settings import KernelSettings

if TYPE_CHECKING:
    from models.tree.layout import CoreCalls


@dataclass
class CoreInputs:
    """Per-row inputs of the chunkwise core (step 4); gather rows of all five for replay."""

    q: torch.Tensor
    """`[T, H, K]` L2-normalised queries."""
    k: torch.Tensor
    """`[T, H, K]` L2-normalised keys."""
    v: torch.Tensor
    """`[T, HV, V]` values."""
    g: torch.Tensor
    """log decay in the upcast dtype (fp32; float64 for float64 models): `[T, HV]` (GDN) or `[T, HV, K]` (KDA)."""
    beta: torch.Tensor
    """`[T, HV]` write strengths in (0, 1)."""


class LinearAttention(nn.Module):
    """Base of `GatedDeltaNet` and `KimiDeltaAttention`: owns the conv and the core call; subclasses define
    `conv_groups`, `project`, `activate`, `output` and the core op `core_op`."""

    core_op: Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    """`models.ops` chunk op with the signature of `naive_chunk_kda` (set by the subclass)."""
    calls_op: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    """Fast path of `core_calls` where fla runs (`models.ops.kda.tree_calls.fla_kda_calls`); None: call by call."""
    kernels: KernelSettings = KernelSettings()
    """Which kernels its ops run (`models.ops.settings`); the model it belongs to sets it
    (`HybridForCausalLM.use_kernels`)."""

    def __init__(self, conv_channels: int, conv_size: int, chunk_size: int):
        super().__init__()
        self.conv_size = conv_size
        self.chunk_size = chunk_size
        # Depthwise, no bias; held as nn.Conv1d so the parameter is `conv1d.weight` `[C, 1, W]` as in transformers.
        self.conv1d = nn.Conv1d(conv_channels, conv_channels, conv_size, groups=conv_channels, bias=False)

    def conv_groups(self) -> tuple[int, int, int]:
        """Channel widths (C_q, C_k, C_v) of q, k and v in the conv's `[T, C]` input (from the config, which tensor
        parallelism divides)."""
        raise NotImplementedError

    def conv(
        self,
        qkv_TC: torch.Tensor,
        cu_seqlens: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """Step 2: causal depthwise conv + silu of each packed sequence (restarting at every sequence), one call per
        channel group, so q, k and v come out contiguous (the core's kernels take them without a copy) whatever the
        input's row stride (it may be a column slice of a wider projection output).

        Args:
            qkv_TC: `[T, C]` step-1 output, C = C_q + C_k + C_v.
            cu_seqlens: LongTensor `[N+1]`.
            initial_state: `[N, C, W]` the inputs preceding each sequence (fla convention), None = zeros.
            output_final_state: also return each sequence's last inputs `[N, C, W]`.
        Returns: ((q `[T, C_q]`, k `[T, C_k]`, v `[T, C_v]`), final state or None).
        """
        groups = self.conv_groups()
        # One split each (not slices): the gradients of the three parts meet in one concatenation in backward.
        parts = zip(qkv_TC.split(groups, dim=-1), self.conv1d.weight[:, 0, :].split(groups),
                    initial_state.split(groups, dim=1) if initial_state is not None else [None] * len(groups))
        outputs, finals = [], []
        for x_TC, weight, state in parts:
            y, final = short_conv(x_TC[None], weight, bias=None, initial_state=state,
                                  output_final_state=output_final_state, activation="silu", cu_seqlens=cu_seqlens)
            outputs.append(y[0])
            finals.append(final)
        return tuple(outputs), torch.cat(finals, dim=1) if output_final_state else None

    def conv_restarted(
        self, qkv_TC: torch.Tensor, cu_seqlens: torch.Tensor, fix: RecomputedRows | None,
        extra_RC: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 2 for sequences whose history lies elsewhere (tree execution): every sequence convolved from zeros,
        then the rows `fix` names recomputed from their history, rows of `[qkv; extra]`
        (`models.ops.conv.recomputed_rows`). Returns (q, k, v) as `conv`; with `fix` None, `conv` from zeros."""
        if fix is None:
            return self.conv(qkv_TC, cu_seqlens)[0]
        return conv_recomputed_rows(qkv_TC, extra_RC, self.conv1d.weight[:, 0, :], self.conv_groups(), cu_seqlens,
                                    fix)

    def core(
        self,
        inputs: CoreInputs,
        cu_seqlens: torch.Tensor,
        cu_seqlens_cpu: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 4: the chunkwise delta rule with chunk size `self.chunk_size` restarting at every sequence.

        Args:
            inputs: step-3 output.
            cu_seqlens: LongTensor `[N+1]`; cu_seqlens_cpu: its host copy, optional (spares a host sync on CUDA).
            initial_state: `[N, HV, K, V]` fp32 state per sequence (differentiable), None = zeros.
            output_final_state: return the state after each sequence.
        Returns: (o `[T, HV, V]`, final state `[N, HV, K, V]` or None).
        """
        o, final = self.core_op(
            inputs.q[None], inputs.k[None], inputs.v[None], inputs.g[None], inputs.beta[None],
            scale=None, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=self.chunk_size,
        )
        return o[0], final

    def core_calls(
        self, inputs: CoreInputs, calls: CoreCalls, outside: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 4 for tree execution: a layer's kernel calls in order, each piece starting from an entry of the state
        table (`models.tree.layout.CoreCalls`: zeros, `outside`, earlier calls' final states).

        Args:
            inputs: the calls' rows, call after call.
            calls: the calls, with each piece's table entry and, for `calls_op`, fla's chunk bookkeeping of all of
                them.
            outside: `[Y, HV, K, V]` fp32 table entries 1..Y (differentiable; prefix carry), None when Y = 0.
        Returns: (o `[T, HV, V]`, the state table `[M, HV, K, V]` in the upcast dtype).
        Raises ValueError when the calls read another number of outside states or were planned for another chunk
        size. This call-by-call loop is the reference of `calls_op`, which takes the calls' arrays.
        """
        calls.check_outside(outside)
        if calls.chunk_size != self.chunk_size:
            raise ValueError(f"the calls are planned for chunk size {calls.chunk_size} and the mixer runs "
                             f"{self.chunk_size}; plan them with the model's chunk size")
        if self.calls_op is not None and use_fla(inputs.v):
            return self.calls_op(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, outside, calls.cu_seqlens,
                                 calls.chunk_indices, calls.chunk_offsets, calls.calls, calls.chains, calls.chunk_size)
        state_dtype = upcast(inputs.v.dtype)
        HV, K, V = inputs.v.shape[1], inputs.k.shape[2], inputs.v.shape[2]
        table = [inputs.v.new_zeros(HV, K, V, dtype=state_dtype)]  # [HV, K, V] each
        if outside is not None:
            table.extend(outside.to(state_dtype).unbind(0))
        pieces = [t.split(calls.call_rows) for t in (inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)]
        outputs = []
        for j, call in enumerate(calls.calls):
            o, final = self.core(CoreInputs(*(p[j] for p in pieces)), call.cu_seqlens, call.cu_seqlens_cpu,
                                 call.initial_states(table), True)
            outputs.append(o)
            table.extend(final.to(state_dtype).unbind(0))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0], torch.stack(table)

    def forward(self, x_TD: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Flat packed forward from zero states: steps 1-5."""
        rows = self.project(x_TD)
        qkv, _ = self.conv(rows.qkv, cu_seqlens)
        o, _ = self.core(self.activate(rows, qkv), cu_seqlens)
        return self.output(o, rows)
