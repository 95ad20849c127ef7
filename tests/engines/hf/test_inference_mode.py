"""Routes recorded and replayed under `torch.inference_mode()`, and edited in place between two forwards of one
replay there."""

from __future__ import annotations

import torch
from helpers import PAD, left_padded

from moe_replay import Routes, record_routes, replay_routes


def test_routes_recorded_and_replayed_in_inference_mode(qwen):
    """Tensors made in `torch.inference_mode()` count no in-place edits: routes recorded there replay there and
    outside it, and a replay there converts each forward's routes afresh, so that an edit between two forwards of
    one context is replayed (a conversion reused by version would replay the old experts)."""
    ids, mask = left_padded(2, 7, [0, 2])
    with torch.inference_mode(), record_routes(qwen) as rec:
        out = qwen.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=4, pad_token_id=PAD)
        routes = rec.routes
    assert routes.indices.is_inference()
    seq = out.clone()
    full = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
    with torch.no_grad(), replay_routes(qwen, routes):
        expected = qwen(seq, attention_mask=full).logits
    with torch.inference_mode(), replay_routes(qwen, routes):
        assert torch.equal(qwen(seq, attention_mask=full).logits, expected)
    edits = []
    for mode in (torch.inference_mode, torch.no_grad):  # converted there (no version) or outside (the routes' none)
        with mode(), replay_routes(qwen, routes):
            qwen(seq, attention_mask=full)
            with torch.inference_mode():  # (where alone an inference tensor can be edited)
                routes.indices[:, :, 0] = routes.indices[:, :, 0].flip(-1)  # the same experts, in swapped slots
                routes.indices[:, :, 1] = (routes.indices[:, :, 1] + 1) % qwen.config.num_experts  # other experts
            edits.append(qwen(seq, attention_mask=full).logits)
        with torch.no_grad(), replay_routes(qwen, Routes(routes.indices.clone(), routes.mask.clone(), routes.layers)):
            assert torch.equal(edits[-1], qwen(seq, attention_mask=full).logits)
    assert not torch.equal(edits[0], expected) and not torch.equal(edits[1], edits[0])
