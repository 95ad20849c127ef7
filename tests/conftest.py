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
