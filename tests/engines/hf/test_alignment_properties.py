"""Property tests: routes recorded under generate line up with a teacher-forced forward for any padding pattern."""

from __future__ import annotations

import torch
from helpers import extend_mask, left_padded, near_ties, same_but_near_ties, sampled, tiny_qwen3_moe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_replay import Routes, record_routes, replay_routes

MODEL = tiny_qwen3_moe(seed=3)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(2, 8))
    pads = [draw(st.integers(0, T - 1)) for _ in range(B)]
    new = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 1000))
    return B, T, pads, new, seed


# derandomized: generate vs teacher forcing compares float top-k choices, so keep the examples reproducible
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_generate_routes_equal_teacher_forced(case):
    """The routes recorded under generate are the teacher-forced forward's expert sets at every recorded (token,
    layer) pair but its near-ties (`helpers.near_ties`: float noise between the KV-cached decode and the full forward
    may swap those, and then what follows them: `helpers.same_but_near_ties`); replayed, with the pairs left out taken
    from that forward, they give its logits bit for bit."""
    B, T, pads, new, seed = case
    ids, mask = left_padded(B, T, pads, seed=seed)
    torch.manual_seed(seed)
    out, gen = sampled(MODEL, ids, mask, new)
    seq = out.sequences
    full = extend_mask(mask, seq.shape[1]).bool()
    expected = full.clone()
    expected[:, -1] = False  # the last sampled token is never fed
    assert gen.shape[:2] == seq.shape and torch.equal(gen.mask, expected)
    with record_routes(MODEL) as tf:
        forward = MODEL(seq, attention_mask=full.long(), output_router_logits=True)
    assert torch.equal(gen.mask & tf.routes.mask, gen.mask)
    compared = same_but_near_ties(gen, tf.routes, near_ties(forward.router_logits, gen.top_k, seq.shape))
    pinned = Routes(torch.where(compared[..., None], gen.indices, tf.routes.indices), gen.mask, gen.layers)
    with replay_routes(MODEL, pinned):
        assert torch.equal(MODEL(seq, attention_mask=full.long()).logits, forward.logits)
