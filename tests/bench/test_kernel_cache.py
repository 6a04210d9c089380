"""The benchmarks' --kernel-cache (bench.kernel_cache): parsed by every GPU benchmark, set as TRITON_CACHE_DIR and
named on stderr (stdout may carry JSON), and the folder of the kernel settings the benchmark's model gets."""

import argparse
import os

import pytest

from bench.kernel_cache import add_kernel_cache_option, open_kernel_cache
from models.ops.kernel_cache import TRITON_CACHE_ENV


def test_the_option_sets_and_names_the_cache(tmp_path, monkeypatch, capsys, clean_kernel_env):
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "user"))
    parser = argparse.ArgumentParser()
    add_kernel_cache_option(parser)
    kernels = open_kernel_cache(parser.parse_args(["--kernel-cache", str(tmp_path / "kc")]))
    assert kernels.kernel_cache == tmp_path / "kc"
    out = capsys.readouterr()
    assert os.environ[TRITON_CACHE_ENV] == str(tmp_path / "kc") and (tmp_path / "kc").is_dir()
    assert out.out == "" and f"kernel cache {tmp_path / 'kc'} (empty" in out.err and "from --kernel-cache" in out.err
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "user"))
    assert open_kernel_cache(parser.parse_args([])).kernel_cache is None
    assert f"kernel cache {tmp_path / 'user'} " in capsys.readouterr().err, "without the option TRITON_CACHE_DIR holds"


@pytest.mark.parametrize("module", ["speed", "fidelity", "step_profile"])
def test_every_gpu_benchmark_takes_the_option(module, capsys):
    bench = __import__(f"bench.{module}", fromlist=["main"])
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "--kernel-cache DIR" in capsys.readouterr().out
