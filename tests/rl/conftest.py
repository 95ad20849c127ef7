"""The RL tests' shared fixtures: one small warm-started policy per test module, and what the loop compared for its
routing mismatch (the helpers are in rl_utils.py)."""

from __future__ import annotations

from typing import Any

import pytest
from rl_utils import SMALL, live_routes

from moe_replay.rl import loop
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


@pytest.fixture
def mismatch_seen(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """One dict per step `train` runs: the routes sampled under generate ("routes"), the teacher-forced routes at the
    sampling weights that the step's `mismatch/fraction` and first `routes_moved_since_rollout` compare them with
    ("live"), and that forward's near-ties ("near_ties", from one more forward of the same model: `live_routes`)."""
    seen: list[dict[str, Any]] = []
    rollout, teacher_forced = loop.rollout, loop.teacher_forced_routes

    def spied_rollout(*args: Any, **kwargs: Any) -> Any:
        batch = rollout(*args, **kwargs)
        seen.append({"routes": batch.routes})
        return batch

    def spied_teacher_forced(model: Any, sequences: Any, *args: Any, **kwargs: Any) -> Any:
        live = teacher_forced(model, sequences, *args, **kwargs)
        if "live" not in seen[-1]:  # the step's first: right after its rollout, at the sampling weights
            again, ties = live_routes(model, sequences)
            assert again.equal(live)  # (the same forward: its near-ties are those of the one compared)
            seen[-1].update(live=live, near_ties=ties)
        return live

    monkeypatch.setattr(loop, "rollout", spied_rollout)
    monkeypatch.setattr(loop, "teacher_forced_routes", spied_teacher_forced)
    return seen
