"""The rule for fla's GDN backward limit (models.ops.fla_limits), on CPU: versions and capabilities as fla 0.6.0
compares them (`fla.utils.env.TRITON_ABOVE_3_7_1`, `fla.utils.hardware.IS_NVIDIA_HOPPER`)."""

import pytest

from models.ops import fla_limits
from models.ops.fla_limits import gdn_backward_limit, gdn_backward_rule

HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


@pytest.mark.parametrize("version", ["3.4.0", "3.6.0", "3.7.0", "3.7.1rc1", "3.6.0+git8c5e0e1"])
def test_refused_on_hopper_in_the_range(version):
    reason = gdn_backward_rule(version, HOPPER, has_tilelang=False)
    assert reason is not None
    assert f"triton {version}" in reason and ">= 3.4.0, < 3.7.1" in reason and "compute capability 9.0" in reason
    assert "install triton >= 3.7.1 or tilelang" in reason


@pytest.mark.parametrize("version", ["3.3.1", "3.7.1", "3.7.1+git8c5e0e1", "3.8.0", "3.9.0", "4.0.0"])
def test_allowed_outside_the_range(version):
    assert gdn_backward_rule(version, HOPPER, has_tilelang=False) is None


@pytest.mark.parametrize("capability", [AMPERE, BLACKWELL, (12, 0), None])
def test_allowed_on_other_devices(capability):
    assert gdn_backward_rule("3.6.0", capability, has_tilelang=False) is None


def test_tilelang_lifts_it_and_no_triton_or_an_odd_version_never_refuses():
    assert gdn_backward_rule("3.6.0", HOPPER, has_tilelang=True) is None
    assert gdn_backward_rule(None, HOPPER, has_tilelang=False) is None
    assert gdn_backward_rule("not-a-version", HOPPER, has_tilelang=False) is None


def test_the_machine_reading_feeds_the_rule(monkeypatch):
    """gdn_backward_limit reads the installed triton and the CUDA device (here faked as an H200 with triton 3.6.0)."""
    versions = {"triton": "3.6.0", "fla-core": "0.6.0"}
    monkeypatch.setattr(fla_limits, "_installed", versions.get)
    monkeypatch.setattr(fla_limits, "_cuda_capability", lambda: HOPPER)
    monkeypatch.setattr(fla_limits.importlib.util, "find_spec", lambda name: None)
    reason = gdn_backward_limit()
    assert reason is not None and reason.startswith("fla 0.6.0 refuses") and "triton 3.6.0" in reason
    monkeypatch.setattr(fla_limits, "_cuda_capability", lambda: None)
    assert gdn_backward_limit() is None
