"""Shared fixtures (the helpers themselves live in helpers.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import tiny_qwen3_moe
from torch import nn

from moe_replay import keep_warm

# Tiny models: thread start-up costs more than it saves (linear-attention and mamba families run 10-40x slower on 2).
torch.set_num_threads(1)


@pytest.fixture
def qwen() -> nn.Module:
    return tiny_qwen3_moe()


@pytest.fixture
def warm():  # noqa: ANN201
    """Opens `keep_warm` on a model for the rest of the test: `scope = warm(model)` (tests of what contexts keep
    between them, which only a scope keeps)."""
    with contextlib.ExitStack() as stack:
        yield lambda model: stack.enter_context(keep_warm(model))


@pytest.fixture
def auto_path(monkeypatch):  # noqa: ANN001, ANN201
    """The path table's own choice (MOE_REPLAY_PATH unset): for tests of which path a router call takes."""
    monkeypatch.delenv("MOE_REPLAY_PATH", raising=False)


@pytest.fixture(params=["auto", "general"])
def path(request, monkeypatch):  # noqa: ANN001, ANN201
    """Runs a test twice: on the paths the table picks, and with MOE_REPLAY_PATH=general on the general path alone."""
    monkeypatch.setenv("MOE_REPLAY_PATH", request.param)
    return request.param
