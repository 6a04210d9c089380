"""The kernels' environment, set once from a model's `KernelSettings` (`models.ops.kernel_environment`): fla's
tensor cache sized for tree execution unless the user sized it, and Triton's cache at the settings' folder."""

import os

from models.ops.kernel_cache import TRITON_CACHE_ENV
from models.ops.kernel_environment import FLA_TENSOR_CACHE_ENV, FLA_TENSOR_CACHE_SIZE, use_kernel_environment
from models.ops.settings import KernelSettings


def test_the_settings_folder_and_fla_s_tensor_cache(tmp_path, clean_kernel_env):
    cache = use_kernel_environment(KernelSettings(kernel_cache=tmp_path / "kc"), tmp_path / "default", "--x")
    assert cache.folder == tmp_path / "kc" and cache.source == "--x"
    assert os.environ[TRITON_CACHE_ENV] == str(tmp_path / "kc")
    assert os.environ[FLA_TENSOR_CACHE_ENV] == str(FLA_TENSOR_CACHE_SIZE)
    assert use_kernel_environment(KernelSettings(), tmp_path / "default", "--x").folder == tmp_path / "default"


def test_the_user_s_tensor_cache_size_wins(tmp_path, clean_kernel_env, monkeypatch):
    monkeypatch.setenv(FLA_TENSOR_CACHE_ENV, "8")
    use_kernel_environment(KernelSettings(), tmp_path, "--x")
    assert os.environ[FLA_TENSOR_CACHE_ENV] == "8"
