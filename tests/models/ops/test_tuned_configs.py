"""fla kernel configs tuned on a GPU (models.ops.tuned_configs): written from a Triton cache's autotuning records,
they are what fla's own loader finds for the same keys (strict mode), and only for them; `use_tuned_configs` points
fla at a GPU's folder only when the versions match and the user chose nothing."""

import json
import os
import sys

import pytest

from models.ops import tuned_configs
from models.ops.tuned_configs import CACHE_MODE_ENV, CONFIG_DIR_ENV, MANIFEST, use_tuned_configs, write_tuned_configs

KEY_A = [16, 16, 128, 128, 64, False, "torch.bfloat16", "torch.float32"]
KEY_B = [32, 16, 128, 128, 64, True, "torch.bfloat16", "torch.float32"]


def config(bv: int, warps: int, stages: int) -> dict:
    return {"kwargs": {"BV": bv}, "num_warps": warps, "num_ctas": 1, "num_stages": stages, "maxnreg": None,
            "pre_hook": None, "ir_override": None}


def record(folder, kernel: str, key: list, timings: list) -> None:
    """A Triton `<kernel>.autotune.json` as `triton.runtime.autotuner.Autotuner.check_disk_cache` writes it."""
    folder.mkdir(parents=True)
    (folder / f"{kernel}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": timings}))


@pytest.fixture
def triton_cache(tmp_path):
    cache = tmp_path / "kc"
    record(cache / "A1", "fwd_kernel_h", KEY_A, [[config(32, 4, 2), [0.9, 0.8, 1.0]],
                                                [config(64, 4, 3), [0.7, 0.6, 0.9]]])
    record(cache / "A2", "fwd_kernel_h", KEY_B, [[config(32, 2, 3), [0.5, 0.5, 0.6]],
                                                [config(64, 8, 3), [0.5, 0.4, 0.6]]])
    record(cache / "B1", "bwd_kernel", KEY_A, [[config(16, 1, 2), [2.0, 2.0, 2.0]]])
    (cache / "C1").mkdir()  # a compiled kernel, no autotuning record
    return cache


def test_fla_loads_the_config_each_key_was_tuned_to_and_no_other(triton_cache, tmp_path, monkeypatch):
    from fla.ops.utils import cache as fla_cache

    out = tmp_path / "NVIDIA_H200"
    assert write_tuned_configs(triton_cache, out, "NVIDIA H200", "a test") == {"fwd_kernel_h": 2, "bwd_kernel": 1}
    assert json.loads((out / MANIFEST).read_text())["tuned_on"] == "a test"
    monkeypatch.setattr(fla_cache, "FLA_CACHE_MODE", fla_cache.FlaCacheMode.STRICT)
    monkeypatch.setenv(CONFIG_DIR_ENV, str(out))
    fla_cache.load_config_file.cache_clear()

    def load(kernel, key):
        return fla_cache.load_cached_config(kernel, fla_cache.AutotuneKey(tuple(key)))

    expected = {k: v for k, v in config(64, 4, 3).items() if k != "pre_hook"}
    assert load("fwd_kernel_h", KEY_A) == expected  # the least median, not the least p20
    assert load("fwd_kernel_h", KEY_B)["num_warps"] == 8  # equal medians: the least p20
    assert load("bwd_kernel", KEY_A)["kwargs"] == {"BV": 16}
    assert load("bwd_kernel", KEY_B) is None and load("other_kernel", KEY_A) is None
    assert load("fwd_kernel_h", KEY_A[:-1] + ["torch.bfloat16"]) is None  # another dtype is another key


def test_two_tunings_of_one_key_are_refused(triton_cache, tmp_path):
    record(triton_cache / "A3", "fwd_kernel_h", KEY_A, [[config(32, 4, 2), [0.1, 0.1, 0.1]]])
    with pytest.raises(ValueError, match="two different tuned configs"):
        write_tuned_configs(triton_cache, tmp_path / "out", "NVIDIA H200", "a test")


def test_the_folder_of_the_gpu_in_use_with_matching_versions(triton_cache, tmp_path, clean_kernel_env, monkeypatch):
    write_tuned_configs(triton_cache, tmp_path / "NVIDIA_H200", "NVIDIA H200", "bench.speed")
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    said = use_tuned_configs("NVIDIA H200", root=tmp_path)
    assert said == f"fla kernel configs: {tmp_path / 'NVIDIA_H200'} (tuned on bench.speed)"
    assert os.environ[CONFIG_DIR_ENV] == str(tmp_path / "NVIDIA_H200") and os.environ[CACHE_MODE_ENV] == "strict"
    assert use_tuned_configs("NVIDIA H200", root=tmp_path) == said  # a second job: the folder is not the user's


def test_why_not(triton_cache, tmp_path, clean_kernel_env, monkeypatch):
    assert use_tuned_configs("NVIDIA H100 80GB HBM3", root=tmp_path) == (
        "fla kernel configs: none tuned for NVIDIA H100 80GB HBM3 here: fla autotunes on first use")
    write_tuned_configs(triton_cache, tmp_path / "NVIDIA_H200", "NVIDIA H200", "bench.speed")
    monkeypatch.setattr(tuned_configs, "_versions", lambda: {"triton": "9.9.9", "fla": "0.6.0"})
    assert "this is triton 9.9.9 and fla 0.6.0: fla autotunes on first use" in use_tuned_configs(
        "NVIDIA H200", root=tmp_path)
    monkeypatch.undo()
    monkeypatch.setenv(CONFIG_DIR_ENV, "/my/configs")
    said = use_tuned_configs("NVIDIA H200", root=tmp_path)
    assert said == "fla kernel configs: FLA_CONFIG_DIR=/my/configs (the user's)"
    monkeypatch.delenv(CONFIG_DIR_ENV)
    monkeypatch.setenv(CACHE_MODE_ENV, "fuzzy")
    said = use_tuned_configs("NVIDIA H200", root=tmp_path)
    assert said == "fla kernel configs: FLA_CACHE_MODE=fuzzy (the user's)"
    monkeypatch.delenv(CACHE_MODE_ENV)
    monkeypatch.setitem(sys.modules, "fla", sys.modules.get("fla", object()))
    assert "fla was imported before" in use_tuned_configs("NVIDIA H200", root=tmp_path)
    assert CONFIG_DIR_ENV not in os.environ and CACHE_MODE_ENV not in os.environ
