"""`replay_routes(..., track_live=True)`: how many replayed experts each router would have picked otherwise."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, perturb, recorded, tiny_qwen3_moe

from moe_replay import expert_change, replay_routes, teacher_forced_routes


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non_reentrant"])
def test_live_moved_counts_what_live_routing_would_change(checkpointing):
    """First MoE layer: exactly the teacher-forced change (its input is the same under replay); later layers see the
    replayed upstream, so they are compared on that. Gradient checkpointing's recompute is not counted twice and
    saves the same tensors as the forward (the live top-k runs without grad)."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(4, 12, [0, 2, 5, 1])
    routes = recorded(model, ids, mask)
    perturb(model, 0.3)
    live = teacher_forced_routes(model, ids, mask)
    if checkpointing:
        model.train()
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    with replay_routes(model, routes, track_live=True) as ctx:
        model(ids, attention_mask=mask).logits.sum().backward()
    moved, compared = ctx.live_moved()
    change = expert_change(routes, live)
    assert compared.tolist() == [change.num_tokens] * len(routes.layers)
    assert int(moved[0]) == int(change.changed[..., 0][change.valid].sum()) > 0
    assert 0 < int(moved[1]) <= int(compared[1]) * routes.top_k


def test_live_moved_is_zero_for_own_routes_and_needs_the_flag(qwen):
    ids, mask = left_padded(2, 8, [0, 3])
    routes = recorded(qwen, ids, mask)
    with replay_routes(qwen, routes, track_live=True) as ctx:
        qwen(ids, attention_mask=mask)
    moved, compared = ctx.live_moved()
    assert moved.tolist() == [0, 0] and compared.tolist() == [int(routes.mask.sum())] * 2
    with replay_routes(qwen, routes) as plain:
        qwen(ids, attention_mask=mask)
    with pytest.raises(ValueError, match="track_live=True"):
        plain.live_moved()
    assert torch.equal(moved, ctx.live_moved()[0])
