"""The chain variant of fla's recurrence kernels (`models.ops.kda.chains`) without a GPU: run by Triton's CPU
interpreter against their plain-torch reference, and compiled for the H200 (sm_90) next to fla's stock kernels, whose
arithmetic they must repeat instruction for instruction (tree and flat then compute the same bits); their launch
configs taken from the stock kernels' tuned files. On CUDA, `test_kda_calls.py` runs them inside the tree's calls."""

import json
import re

import pytest

from tests.models.ops.interpreted import run_under_interpreter

ARITHMETIC = ("wgmma.mma_async", "mma.sync", "ex2", "mul.f32", "fma", "add.f32", "sub.f32", "cvt.rn.bf16")


def test_chain_kernels_match_their_reference_under_triton_s_interpreter():
    """The chain kernels' Triton code, run on the CPU by Triton's interpreter in a fresh process
    (`tests.models.ops.chains_interpreted`), against `models.ops.kda.naive_chains`: every output to fp32 rounding
    relative to its largest magnitude, and the recomputation's chunk states equal to the forward's."""
    report = run_under_interpreter(["-m", "tests.models.ops.chains_interpreted"], timeout=900)
    assert len(report) == 26
    for case, diffs in report.items():
        assert diffs.pop("recomputation's h - forward's") == 0, case
        assert diffs and all(d < 2e-6 for d in diffs.values()), (case, diffs)


def _arithmetic(ptx: str) -> list[str]:
    """A kernel's floating-point dataflow from its PTX: its arithmetic instructions in program order, registers
    renamed by first use, the 64-bit ones (shared-memory descriptors of the matrix products: addresses) blanked,
    after the leading adds that put the initial state (or its gradient) into registers (fla adds it to a literal
    zero, the chains to the registers a sequence's previous piece left: the same values)."""
    lines = []
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@%p\d+\s+)?([a-z][\w.]*)\s*(.*)", line)
        if m and any(a in m.group(1) for a in ARITHMETIC):
            lines.append((m.group(1), re.sub(r"%rd\d+", "%rd", m.group(2))))
    first = next(i for i, (op, _) in enumerate(lines) if op != "add.f32")
    names: dict[str, str] = {}
    rename = lambda m: names.setdefault(m.group(0), f"r{len(names)}")  # noqa: E731
    return [f"{op} {re.sub(r'%[a-z]+[0-9]+', rename, args)}" for op, args in lines[first:]]


def _compile(fn, signature: dict, constexprs: dict, num_stages: int):
    """`fn` compiled for sm_90 with Triton's floating-point fusion on (its default through 3.9, as on the H200)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=num_stages, enable_fp_fusion=True))
    except RuntimeError as error:  # no ptxas / CUDA backend in this Triton install
        pytest.skip(f"Triton cannot compile for sm_90 here: {error}")


@pytest.mark.parametrize("K, BV", [(128, 32), (256, 64), (64, 32)])
def test_chain_kernels_repeat_fla_s_arithmetic_on_the_h200(K, BV):
    """Compiled for sm_90 with the H200's tuned launch config, each chain kernel runs the same floating-point
    instructions on the same operands in the same order as fla's stock kernel with our flags (per-channel gate,
    K-first states, varlen, initial state and final state / its gradient): only the loop over a sequence's pieces
    and the addressing differ. PTX, before ptxas schedules it; the H200 run of `test_kda_calls.py` checks bits."""
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 as stock_bwd,
    )
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as stock_fwd,
    )

    from models.ops.kda.chains import chain_bwd_kernel_dhu, chain_fwd_kernel_h

    bf, f32, i64, c = "*bf16", "*fp32", "*i64", "constexpr"
    shapes = dict(H=16, HV=16, K=K, V=128, BT=64, BV=BV)
    chains = dict(chain_pieces=i64, piece_bos=i64, piece_eos=i64, piece_boh=i64, piece_state=i64)
    flags = dict(USE_G=False, USE_GK=True, USE_INITIAL_STATE=True, STATE_V_FIRST=False, IS_VARLEN=True)
    fwd = [
        _compile(stock_fwd.fn.fn, dict(k=bf, v=bf, w=bf, v_new=bf, g=f32, gk=f32, h=bf, h0=f32, ht=f32,
                                       cu_seqlens=i64, chunk_offsets=i64, T="i32", **{n: c for n in shapes},
                                       **{n: c for n in flags}, STORE_FINAL_STATE=c, SAVE_NEW_VALUE=c),
                 {**shapes, **flags, "STORE_FINAL_STATE": True, "SAVE_NEW_VALUE": True}, 4),
        _compile(chain_fwd_kernel_h, dict(k=bf, u=bf, w=bf, v_new=bf, gk=f32, h=bf, table=f32, **chains,
                                          chain_init=i64, **{n: c for n in shapes}, STORE_STATES=c),
                 {**shapes, "STORE_STATES": True}, 4),
    ]
    bwd = [
        _compile(stock_bwd.fn.fn, dict(q=bf, k=bf, w=bf, g=f32, gk=f32, dht=f32, dh0=f32, do=bf, dh=bf, dv=bf,
                                       dv2=bf, cu_seqlens=i64, chunk_offsets=i64, scale="fp32", T="i32",
                                       **{n: c for n in shapes}, **{n: c for n in flags}, USE_FINAL_STATE_GRADIENT=c),
                 {**shapes, **flags, "USE_FINAL_STATE_GRADIENT": True}, 3),
        _compile(chain_bwd_kernel_dhu, dict(q=bf, k=bf, w=bf, gk=f32, d_table=f32, dh0=f32, do=bf, dh=bf, dv=bf,
                                            dv2=bf, **chains, scale="fp32", **{n: c for n in shapes}), shapes, 3),
    ]
    for name, (stock, chain) in (("forward", fwd), ("backward", bwd)):
        expected = _arithmetic(stock.asm["ptx"])
        assert len(expected) > 50 and any(op.startswith("wgmma.mma_async") for op in expected), name
        assert _arithmetic(chain.asm["ptx"]) == expected, name


@pytest.fixture
def fla_strict_configs(monkeypatch):
    """fla looking up tuned configs by exact key (`FLA_CACHE_MODE=strict`, as `use_tuned_configs` sets it before fla
    is imported), with no lookups cached from before or left for after."""
    from fla.ops.utils import cache as fla_cache

    from models.ops.kda import chains

    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.STRICT)
    clears = (fla_cache.load_config_file.cache_clear, chains._cached_config.cache_clear)
    for clear in clears:
        clear()
    yield
    for clear in clears:
        clear()


def test_chain_launch_configs_are_the_stock_kernels_tuned_ones_for_flat_s_call(tmp_path, monkeypatch,
                                                                                fla_strict_configs):
    """The chain kernels launch with the config fla's stock kernel runs flat's call with, as fla looks it up in the
    folder it reads (`FLA_CONFIG_DIR`): the entry of exactly the key of flat's call (shapes, flags, dtypes); None,
    and the calls run call by call, where there is none (fla autotunes then)."""
    import torch
    from fla.ops.utils.cache import AutotuneKey

    from models.ops.kda import chains
    from models.ops.tuned_configs import CONFIG_DIR_ENV

    bf, f32, i64 = "torch.bfloat16", "torch.float32", "torch.int64"
    key = [16, 16, 128, 128, 64, False, False, bf, bf, bf, f32, bf, bf, bf, bf, i64, i64]
    with_dht = key[:11] + [f32] + key[11:]
    entries = {AutotuneKey.key_hash(key): {"autotune_key": key, "config": {"kwargs": {"BV": 64}, "num_warps": 2,
                                                                            "num_stages": 4, "num_ctas": 1}},
               AutotuneKey.key_hash(with_dht): {"autotune_key": with_dht, "config": {
                   "kwargs": {"BV": 32}, "num_warps": 4, "num_stages": 1, "num_ctas": 1}}}
    (tmp_path / "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64.json").write_text(
        json.dumps({"autotune_entries": entries}))
    q, do, gk = (torch.empty(1, 8, 16, 128, dtype=d, device="meta") for d in (torch.bfloat16,) * 2 + (torch.float32,))
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)
    assert chains.bwd_config(q, do, gk, 64) is None  # no folder of ours (fla's own holds none for this machine)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(tmp_path))
    assert chains.bwd_config(q, do, gk, 64) == {"BV": 64, "num_warps": 2, "num_stages": 4}
    assert chains.bwd_config(q, do, gk, 32) is None  # other chunk size
    assert chains.bwd_config(q, do.float(), gk, 64) is None  # other dtypes
    assert chains.fwd_config(q, do, gk, 64) is None  # no file for the forward kernel


def test_h200_tuned_configs_hold_flat_s_stock_recurrence_calls(monkeypatch, fla_strict_configs):
    """The H200's tuned folder holds the entries of flat's stock recurrence calls at ling-3-tiny's shapes (bf16
    inputs, fp32 gate cumsum), so the chain kernels run there with flat's tiles."""
    import torch

    from models.ops.kda import chains
    from models.ops.tuned_configs import CONFIG_DIR_ENV, TUNED_CONFIGS

    monkeypatch.setenv(CONFIG_DIR_ENV, str(TUNED_CONFIGS / "NVIDIA_H200"))
    x, g = torch.empty(1, 8, 16, 128, dtype=torch.bfloat16, device="meta"), torch.empty(1, 8, 16, 128, device="meta")
    assert chains.fwd_config(x, x, g, 64) == {"BV": 32, "num_warps": 4, "num_stages": 4}
    assert chains.bwd_config(x, x, g, 64) == {"BV": 32, "num_warps": 4, "num_stages": 3}
