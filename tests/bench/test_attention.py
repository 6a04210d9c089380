"""bench.attention on CPU: the cases are the step's fullest flat microbatch and heaviest tree microbatch, the flex
layout of a flat microbatch is its causal mask, unsupported backends print one reason line, and the table runs."""

import argparse
from pathlib import Path

import pytest
import torch

from bench import attention
from bench.kernel_choice import add_kernel_choice_options, kernel_choice
from bench.speed import first_fit_flat
from bench.workloads import swe_like_step
from models.attention_core import VarlenCausalMask
from models.ops.settings import KernelSettings

TINY = ["--device", "cpu", "--token-scale", "0.002", "--model", "tiny-kimi-linear", "--repeat", "1"]


def test_chain_layout_is_the_flat_causal_mask():
    cu = torch.tensor([0, 3, 4, 9])
    assert torch.equal(attention.chain_layout(cu).dense_mask(), VarlenCausalMask(cu).dense())


def test_cases_are_the_steps_fullest_flat_and_heaviest_tree_microbatch():
    flat, tree = attention.step_cases(5, 0.01, 0.002, 65536, "tiny-kimi-linear", torch.device("cpu"))
    trajs = swe_like_step(5, scale=0.01, token_scale=0.002, vocab_size=1000, max_path_tokens=65536)
    assert flat.queries == max(sum(len(trajs[i]) for i in g) for g in first_fit_flat(trajs, 65536))
    assert flat.cu.diff().sum() == flat.queries == flat.key_rows
    assert tree.queries < tree.key_rows
    assert tree.flex_layout.kv_index.numel() == tree.key_rows


def test_model_shapes_are_the_presets_full_attention():
    assert attention.model_shapes("ling-3-tiny") == attention.Shapes(16, 16, 192, 128)
    assert attention.model_shapes("tiny-qwen3-next") == attention.Shapes(4, 2, 64, 64)


def test_cpu_table_with_reasons(capsys):
    assert attention.main([*TINY, "--backends", "reference,flash,varlen"]) == 0
    out = capsys.readouterr().out
    for case in ("flat", "tree"):
        assert f"{case} flash: cannot run: needs CUDA" in out
        assert f"{case} varlen: cannot run: needs CUDA" in out
        row = next(line for line in out.splitlines() if line.startswith(f"{case}  reference"))
        assert "0.0e+00" in row
    assert "command: python -m bench.attention" in out


def test_unknown_backend_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        attention.main(["--backends", "flash,fa3"])
    assert "fa3" in capsys.readouterr().err


def test_fa4_names_what_it_lacks(no_fa4):
    """FlashAttention-4 (a separate package) needs CUDA and flash-attn-4, and says so when it cannot run."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    flat = attention.flat_case([5, 3], cpu)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        attention.backend_attention("fa4", flat, cpu)
    with pytest.raises(RuntimeError, match="flash-attn-4 is not importable"):
        attention.backend_attention("fa4", flat, cuda)


def test_a_backend_runs_training_s_attention_with_its_pair(fake_fa4):
    """A row of a CUDA pair runs the case's training attention with that pair (the autograd Functions keep its
    backward), each row its own."""
    flat = attention.flat_case([5, 3], torch.device("cpu"))
    seen = []
    case = attention.Case("flat", 8, 8, kernels=lambda pair: lambda q, k, v: seen.append(pair),
                          reference=flat.reference, flex_layout=flat.flex_layout)
    for name in ("fa4", "flash"):
        attention.backend_attention(name, case, torch.device("cuda"))(None, None, None)
    assert seen == ["fa4", "flash"]


def test_the_attention_kernels_option_exits_with_the_reason(no_fa4):
    parser = argparse.ArgumentParser()
    add_kernel_choice_options(parser)
    with pytest.raises(SystemExit, match="--attention-kernels fa4: flash-attn-4 is not importable"):
        kernel_choice(parser.parse_args(["--attention-kernels", "fa4"]))
    args = parser.parse_args(["--reference-rowwise"])
    kernels = kernel_choice(args, kernels=KernelSettings(kernel_cache=Path("kc")))
    assert kernels == KernelSettings(fused_rowwise=False, attention="flash", kernel_cache=Path("kc"))
    assert args.attention_kernels == "flash"


def test_the_default_attention_kernels_are_fa4_where_it_can_run(fake_fa4):
    """--attention-kernels auto (the default) runs fa4 where `require_fa4` passes, and the arguments then name it, so
    a benchmark's header and records say which pair ran."""
    parser = argparse.ArgumentParser()
    add_kernel_choice_options(parser)
    args = parser.parse_args([])
    assert kernel_choice(args) == KernelSettings(attention="fa4") and args.attention_kernels == "fa4"
