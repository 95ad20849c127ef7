"""The RL tests' shared fixture: one small warm-started policy per test module (the helpers are in rl_utils.py)."""

from __future__ import annotations

import pytest
from rl_utils import SMALL

from moe_replay.rl.policy import build_policy, warm_start
from moe_replay.rl.tasks import Task


@pytest.fixture(scope="module")
def init(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small warm-started policy shared by the tests."""
    path = tmp_path_factory.mktemp("init")
    model = build_policy(SMALL, seed=0)
    warm_start(model, Task("addition", 2), steps=30, batch=64, seed=0)
    model.save_pretrained(path)
    return str(path)
