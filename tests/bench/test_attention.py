"""bench.attention on CPU: the cases are the step's fullest flat microbatch and heaviest tree microbatch, the flex
layout of a flat microbatch is its causal mask, unsupported backends print one reason line, and the table runs."""

import argparse

import pytest
import torch

from bench import attention
from bench.kernel_choice import add_kernel_choice_options, use_kernel_choice
from bench.speed import first_fit_flat
from bench.workloads import swe_like_step
from models.attention_core import VarlenCausalMask
from models.ops.varlen_attention import cuda_attention

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


def test_a_backend_runs_its_pair_and_restores_the_one_in_use(fake_fa4):
    """A row's attention runs with its pair chosen (the autograd Functions keep that pair's backward) and leaves the
    pair in use as it was."""
    seen = []
    run = attention.with_cuda_attention("fa4", lambda q, k, v: seen.append(cuda_attention()))
    run(None, None, None)
    assert seen == ["fa4"] and cuda_attention() == "flash"


def test_the_attention_kernels_option_exits_with_the_reason(no_fa4):
    parser = argparse.ArgumentParser()
    add_kernel_choice_options(parser)
    with pytest.raises(SystemExit, match="--attention-kernels fa4: flash-attn-4 is not importable"):
        use_kernel_choice(parser.parse_args(["--attention-kernels", "fa4"]))
    args = parser.parse_args([])
    use_kernel_choice(args)
    assert cuda_attention() == "flash" and args.attention_kernels == "flash"


def test_the_default_attention_kernels_are_fa4_where_it_can_run(fake_fa4):
    """--attention-kernels auto (the default) runs fa4 where `require_fa4` passes, and the arguments then name it, so
    a benchmark's header and records say which pair ran."""
    parser = argparse.ArgumentParser()
    add_kernel_choice_options(parser)
    args = parser.parse_args([])
    use_kernel_choice(args)
    assert cuda_attention() == "fa4" and args.attention_kernels == "fa4"
