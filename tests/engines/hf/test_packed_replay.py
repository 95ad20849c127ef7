"""Packed (padding-free) batches on Hugging Face transformers: a row of concatenated sequences with restarting
position_ids, no attention mask and no cache runs each sequence on its own (transformers' packed-sequence masks);
replaying `to_packed` of the padded batch's routes there gives the padded forward's per-token log-probs and router
gradients, and a forward that transformers would not separate (an attention mask, a cache, positions that do not
restart at the sequences' starts) is refused before it runs."""

from __future__ import annotations

import pytest
import torch
from helpers import perturb, tiny_qwen3_moe

from moe_replay import record_routes, replay_routes, to_packed
from moe_replay.errors import ReplayError

LENGTHS = (5, 7, 3)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three right-padded sequences [3, 7] and their attention mask."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 32, (len(LENGTHS), max(LENGTHS)), generator=g)
    keep = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    return ids * keep, keep


def packed_row(ids: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences concatenated in one row [1, 15] and their restarting position_ids."""
    return ids[keep.bool()][None], torch.cat([torch.arange(n) for n in LENGTHS])[None]


def router_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]


def token_logp(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1)[..., :-1, :].gather(-1, ids[..., 1:, None])[..., 0]


def recorded_and_packed() -> tuple:
    """A tiny Qwen3-MoE, the padded batch, its packed row with restarting positions, the padded forward's recording
    and `to_packed` of it."""
    model = tiny_qwen3_moe()
    ids, keep = padded_batch()
    row, positions = packed_row(ids, keep)
    with torch.no_grad(), record_routes(model) as rec:
        model(ids, attention_mask=keep)
    return model, ids, keep, row, positions, rec, to_packed(rec.routes, keep)


def test_packed_replay_gives_the_padded_forward_and_refuses_a_forward_that_mixes_sequences():
    model, ids, keep, row, positions, rec, packed = recorded_and_packed()
    perturb(model)  # live routing now moves: the replay has to force the recorded experts

    with replay_routes(model, rec.routes):
        logits = model(ids, attention_mask=keep).logits
        padded_logp = token_logp(logits, ids)
        (padded_logp * keep[:, 1:]).sum().backward()
    expected_grads = router_grads(model)
    model.zero_grad()
    with replay_routes(model, packed) as ctx:
        logits = model(row, position_ids=positions, use_cache=False).logits
        logp = token_logp(logits, row)[0]
        inside = torch.cat([torch.arange(n) < n - 1 for n in LENGTHS])[:-1]  # next token in the same sequence
        logp[inside].sum().backward()
    assert ctx.routes is packed.routes
    torch.testing.assert_close(logp[inside], padded_logp[keep[:, 1:].bool()], rtol=1e-5, atol=1e-5)
    for got, want in zip(router_grads(model), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    # the trap: with the default use_cache (or a mask), transformers lets the sequences attend to each other
    with torch.no_grad():
        mixed = token_logp(model(row, position_ids=positions).logits, row)[0]
    assert (mixed[inside] - logp[inside].detach()).abs().max() > 1e-3  # (it really computes something else)
    from transformers import DynamicCache

    refusals = {
        "makes a KV cache \\(use_cache is on": {"position_ids": positions},
        "given a KV cache": {"position_ids": positions, "use_cache": False, "past_key_values": DynamicCache()},
        "given an attention_mask": {
            "position_ids": positions,
            "attention_mask": torch.ones_like(row),
            "use_cache": False,
        },
        "given no position_ids": {"use_cache": False},
        "position 5 is 5, expected 0": {"position_ids": torch.arange(row.shape[1])[None], "use_cache": False},
    }
    for why, kwargs in refusals.items():
        for given in (packed, packed.routes):  # (the routes know they are packed: checked either way)
            with pytest.raises(ReplayError, match=why), replay_routes(model, given), torch.no_grad():
                model(row, **kwargs)
    model.config.use_cache = False  # an explicit use_cache=True still makes a cache
    with pytest.raises(ReplayError, match="makes a KV cache"), replay_routes(model, packed), torch.no_grad():
        model(row, position_ids=positions, use_cache=True)


def test_the_inner_decoder_called_alone_is_checked_as_the_model_is():
    """Fused-loss trainers call the inner decoder (`model.model(...)`) for hidden states: its forward is checked too
    (found by review: the check sat on the model given, so the inner decoder replayed packed routes with an attention
    mask or a cache, the sequences attending to each other, no error); run as packed sequences, it replays."""
    model, ids, keep, row, positions, rec, packed = recorded_and_packed()
    with torch.no_grad():
        for why, kwargs in {
            "given an attention_mask": {"attention_mask": torch.ones_like(row), "use_cache": False},
            "makes a KV cache": {},
        }.items():
            with pytest.raises(ReplayError, match=why), replay_routes(model, packed):
                model.model(row, position_ids=positions, **kwargs)
        with replay_routes(model, packed):
            hidden = model.model(row, position_ids=positions, use_cache=False).last_hidden_state
            logits = model(row, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)


def test_a_family_not_verified_for_packed_rows_is_refused_by_name():
    """A packed row replayed on a family that lets a packed row's sequences see each other (here Jamba: its
    state-space layers carry state along the row) is refused as the context opens, naming the family (found by review:
    the log-probs were 0.006-0.37 from the padded batch's, no error); see test_packed_families.py for every family."""
    from moe_replay.tiny import tiny_moe

    model = tiny_moe(
        0, model_type="jamba", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=1,
        expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, use_mamba_kernels=False,
    )  # fmt: skip
    ids, keep = padded_batch()
    with torch.no_grad(), record_routes(model) as rec:
        model(ids, attention_mask=keep)
    with pytest.raises(ReplayError, match=r"packed routes replayed on a 'jamba' model \(JambaForCausalLM\)"):
        with replay_routes(model, to_packed(rec.routes, keep)):
            pass
