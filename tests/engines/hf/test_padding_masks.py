"""The padding mask recorded for a forward is the one it ran with: routes are built after the context closes, from
masks read as they were (a plain forward's as it ran, a `generate`'s decode steps once at its end), whatever the
caller then does to its mask buffer."""

from __future__ import annotations

import torch
from helpers import PAD, kv, left_padded

from moe_replay import record_routes


def test_a_reused_mask_buffer_does_not_change_what_was_recorded(qwen):
    """The padding mask of a recorded forward is the one it ran with, even if the caller's buffer (long or bool)
    changes afterwards: routes are built after the context closes."""
    ids = torch.randint(PAD + 1, qwen.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.long, torch.bool):
        buffer = torch.ones(2, 6, dtype=dtype)
        buffer[0, :2] = 0  # left padding of row 0
        with torch.no_grad(), record_routes(qwen) as rec:
            qwen(ids, attention_mask=buffer)
            buffer.fill_(1)
            qwen(ids, attention_mask=buffer)
            buffer[1, :3] = 0
        first, second = rec.batches
        assert first.mask.tolist() == [[False, False, True, True, True, True], [True] * 6]
        assert second.mask.all()


def test_decode_step_masks_are_read_at_the_end_of_a_generate_as_they_were(qwen):
    """Inside `generate` the padding of decode steps is read once, from the latest mask: a hand-written decode loop
    run as the model's `generate` (a step without a mask, a step whose mask covers the new position alone, a padded
    decode position) records what the same loop records step by step, in each of two recorders, also after the
    caller refills its prompt mask buffer."""
    from transformers import DynamicCache

    def loop(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        cache, seq, full = DynamicCache(config=qwen.config), input_ids, attention_mask
        logits = qwen(input_ids, attention_mask=full, **kv(cache), use_cache=True).logits
        for k in range(6):
            token = logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, token], 1)
            if k == 5:  # as in `generate`, the last sampled token is not forwarded
                break
            column = torch.ones(2, 1, dtype=full.dtype)
            if k == 3:
                column[1] = 0  # a padded decode position of row 1
            full = torch.cat([full, column], 1)  # as in `generate`: a new mask per step, the old one extended
            given = None if k == 0 else full[:, -1:] if k == 1 else full
            logits = qwen(token, attention_mask=given, **kv(cache), use_cache=True).logits
        return seq

    got = []
    for as_generate in (False, True):
        ids, mask = left_padded(2, 5, [2, 0], seed=3)
        if as_generate:
            qwen.generate = loop  # the hub wraps it as the model's generate
        try:
            with torch.no_grad(), record_routes(qwen) as rec, record_routes(qwen) as inner:  # two recorders
                seq = qwen.generate(ids, mask) if as_generate else loop(ids, mask)
        finally:
            qwen.__dict__.pop("generate", None)
        mask.fill_(1)  # the caller reuses its buffer before reading the routes
        assert inner.routes.equal(rec.routes)
        got.append((seq, rec.routes))
    (seq, a), (same, b) = got
    assert same.equal(seq) and b.shape[1] == seq.shape[1] == a.shape[1] + 1 and b.indices[:, :-1].equal(a.indices)
    assert b.mask[:, :-1].equal(a.mask) and not b.mask[:, -1].any()  # the last sampled token is never forwarded
    assert b.mask[1, 8].item() is False and b.mask[0, 8].item() is True  # the padded decode position
    assert b.mask[0, :2].tolist() == [False, False] and b.mask[0, 2:-1].all()
