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
