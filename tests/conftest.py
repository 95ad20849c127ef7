"""Shared fixtures (the helpers themselves live in helpers.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_qwen3_moe
from torch import nn

# Tiny models: thread start-up costs more than it saves (linear-attention and mamba families run 10-40x slower on 2).
torch.set_num_threads(1)


@pytest.fixture
def qwen() -> nn.Module:
    return tiny_qwen3_moe()


@pytest.fixture
def declared_path(monkeypatch):  # noqa: ANN001, ANN201
    """MOE_REPLAY_PATH unset: declared router classes take their path (engines/hf/declared.py)."""
    monkeypatch.delenv("MOE_REPLAY_PATH", raising=False)


@pytest.fixture(params=["auto", "general"])
def path(request, monkeypatch):  # noqa: ANN001, ANN201
    """Runs a test twice: declared router classes on their path, and with MOE_REPLAY_PATH=general every router on
    the general path."""
    monkeypatch.setenv("MOE_REPLAY_PATH", request.param)
    return request.param
