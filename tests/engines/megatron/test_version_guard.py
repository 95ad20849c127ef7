"""The Megatron engine refuses a megatron-core outside its tested range when a context first meets a model (not at
import), naming both versions; MOE_REPLAY_MEGATRON_UNTESTED=1 turns the refusal into a warning."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

import megatron.core.package_info  # noqa: E402

from moe_replay.engines.megatron.routers import check_version, megatron_api  # noqa: E402


@pytest.mark.parametrize("version", ["0.16.1", "0.17.0", "0.19.2", "0.19.3rc1"])
def test_versions_in_the_tested_range_pass(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.15.3", "0.20.0", "1.0.0", "0.20.0rc0"])
def test_versions_outside_it_are_refused_naming_both(version, monkeypatch):
    monkeypatch.delenv("MOE_REPLAY_MEGATRON_UNTESTED", raising=False)
    with pytest.raises(ImportError, match=f"megatron-core>=0.16,<0.20 .* but megatron-core {version} is installed"):
        check_version(version)
    monkeypatch.setenv("MOE_REPLAY_MEGATRON_UNTESTED", "1")
    with pytest.warns(UserWarning, match=f"megatron-core {version} is installed"):
        check_version(version)


def test_the_installed_version_is_checked_when_a_context_meets_a_model(monkeypatch):
    monkeypatch.delenv("MOE_REPLAY_MEGATRON_UNTESTED", raising=False)
    megatron_api()  # (the installed one is in range: CI installs the [megatron] extra)
    monkeypatch.setattr(megatron.core.package_info, "__version__", "0.21.0")
    with pytest.raises(ImportError, match="megatron-core 0.21.0 is installed"):
        megatron_api()
