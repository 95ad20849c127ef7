"""GRPO / GSPO / GSPO-token losses: hand-worked values, the paper's gradient identities, masks."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import left_padded, tiny_qwen3_moe

from moe_replay.rl.losses import group_advantages, policy_loss


def test_group_advantages():
    # group 1: mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = 0.7071 -> +-0.7071; group 2: equal rewards -> 0, not NaN
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0]))
    # G = 4: rewards 1, 0, 0, 0 -> mean 0.25, sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0, 0, 0]), 4), torch.tensor([1.5, -0.5, -0.5, -0.5]))
    with pytest.raises(ValueError, match="G=3"):
        group_advantages(torch.zeros(4), 3)


def two_answers(log_ratios_0, log_ratios_1):
    """logp / old_logp / mask for answer 0 with two tokens and answer 1 with one token (+ a padding slot)."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    logp = old + torch.tensor([log_ratios_0, [log_ratios_1[0], 7.0]])  # 7.0 at the padding slot must not matter
    mask = torch.tensor([[True, True], [True, False]])
    return logp, old, mask


def test_grpo_by_hand():
    # answer 0 (A = +1): ratios 1.1, 1.5 -> min(1.1, 1.1) = 1.1, min(1.5, clip 1.27) = 1.27; mean 1.185
    # answer 1 (A = -1): ratio 0.5 -> min(-0.5, -clip 0.8) = -0.8
    # J = (1.185 - 0.8) / 2 = 0.1925; loss = -J
    logp, old, mask = two_answers([math.log(1.1), math.log(1.5)], [math.log(0.5)])
    loss, m = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, importance_sampling_level="token")
    assert loss.item() == pytest.approx(-0.1925, abs=1e-6)
    # 3 answer tokens: one clipped high (1.5 > 1.27, A > 0), one clipped low (0.5 < 0.8, A < 0)
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 3) and m["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    assert m["ratio/unbounded_negative_mean"] == 0.0  # (A < 0 only at ratio 0.5)
    assert m["ratio/max"] == pytest.approx(1.5) and m["ratio/min"] == pytest.approx(0.5)
    assert m["abs_log_ratio/max"] == pytest.approx(math.log(2))
    # the negative answer's ratio at 1.5 instead: A < 0 with r > 1 + 0.27, which the clip leaves unbounded
    logp, old, mask = two_answers([math.log(1.1), math.log(1.5)], [math.log(1.5)])
    _, m = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, importance_sampling_level="token")
    assert m["ratio/unbounded_negative_mean"] == pytest.approx(1 / 3) and m["clip_ratio/low_mean"] == 0.0


def test_gspo_by_hand():
    # answer 0 (A = +1): log s = mean(2e-4, 4e-4) = 3e-4 -> s = 1.00030004 < 1 + 4e-4: unclipped, term = s
    # answer 1 (A = -1): log s = -1e-3 -> s = 0.9990005 < 1 - 3e-4 = 0.9997: min(-0.9990, -0.9997) = -0.9997
    logp, old, mask = two_answers([2e-4, 4e-4], [-1e-3])
    loss, m = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-(math.exp(3e-4) - 0.9997) / 2, abs=2e-7)  # fp32 rounding of 2e-4 offsets
    # answer 1 is clipped: its one token of the three counts; nothing clipped high
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 3) and m["clip_ratio/high_mean"] == 0.0
    # GSPO-token with per-answer advantages: the same value
    loss_t, m_t = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, importance_sampling_level="sequence_token")
    assert loss_t.item() == pytest.approx(loss.item(), abs=1e-7) and m_t == pytest.approx(m)


def test_padding_does_not_matter():
    logp, old, mask = two_answers([0.1, -0.2], [0.3])
    adv = torch.tensor([0.5, -1.0])
    for level in ("token", "sequence", "sequence_token"):
        a, _ = policy_loss(logp, old, adv, mask, importance_sampling_level=level)
        logp2 = logp.clone()
        logp2[1, 1] = -50.0
        b, _ = policy_loss(logp2, old, adv, mask, importance_sampling_level=level)
        assert a.item() == b.item()


def answer_logp(model, seq, mask, start):
    """[N, T_answer] log-probabilities of the tokens from `start` on, from a tiny MoE model (with grad)."""
    logits = model(seq, attention_mask=mask).logits[:, start - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, seq[:, start:, None]).squeeze(-1)


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.fixture
def setup():
    model = tiny_qwen3_moe()
    seq, mask = left_padded(4, 10, [0, 1, 0, 2], seed=3)
    answer = torch.ones(4, 4, dtype=torch.bool)
    answer[1, 3] = answer[3, 2:] = False  # unequal answer lengths 4, 3, 4, 2
    return model, seq, mask, answer


def test_gspo_gradient_is_s_a_mean_grad_logp(setup):
    model, seq, mask, answer = setup
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    noise = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 1e-5
    old = (answer_logp(model, seq, mask, 6) + noise).detach()  # ratios within 1e-4 of 1: no clipping at 3e-4/4e-4
    loss, m = policy_loss(answer_logp(model, seq, mask, 6), old, adv, answer, importance_sampling_level="sequence")
    assert m["clip_ratio/region_mean"] == 0.0
    got = grads(model, loss)
    # the paper's gradient: s_i A_i (1/|o_i|) sum_t grad log pi(o_it), averaged over answers (sign: loss = -J)
    logp = answer_logp(model, seq, mask, 6)
    n = answer.sum(1)
    s = torch.exp(((logp - old) * answer).sum(1) / n).detach()
    surrogate = -(s * adv * (logp * answer).sum(1) / n).mean()
    want = grads(model, surrogate)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-8)


def test_grpo_equals_gspo_and_gspo_token_on_the_first_minibatch(setup):
    model, seq, mask, answer = setup
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    old = answer_logp(model, seq, mask, 6).detach()  # first minibatch: pi_theta == pi_old, every ratio is 1
    out = {}
    for level in ("token", "sequence", "sequence_token"):
        loss, m = policy_loss(answer_logp(model, seq, mask, 6), old, adv, answer, importance_sampling_level=level)
        out[level] = (loss.item(), grads(model, loss))
        assert m["ratio/mean"] == pytest.approx(1.0) and m["clip_ratio/region_mean"] == 0.0
    for level in ("sequence", "sequence_token"):
        assert out[level][0] == pytest.approx(out["token"][0], abs=1e-6)
        for g, w in zip(out[level][1], out["token"][1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-8)


def test_gspo_token_matches_gspo_off_policy_too(setup):
    model, seq, mask, answer = setup
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    noise = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)) * 2e-3  # some answers clipped
    old = (answer_logp(model, seq, mask, 6) + noise).detach()
    a, ma = policy_loss(answer_logp(model, seq, mask, 6), old, adv, answer, importance_sampling_level="sequence")
    b, mb = policy_loss(answer_logp(model, seq, mask, 6), old, adv, answer, importance_sampling_level="sequence_token")
    assert (
        a.item() == pytest.approx(b.item(), abs=1e-6) and ma == pytest.approx(mb) and ma["clip_ratio/region_mean"] > 0
    )
    ga = grads(model, a)
    gb = grads(
        model,
        policy_loss(answer_logp(model, seq, mask, 6), old, adv, answer, importance_sampling_level="sequence_token")[0],
    )
    for g, w in zip(ga, gb, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)


def test_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="importance_sampling_level must be one of"):
        policy_loss(x, x, torch.zeros(2), x.bool(), importance_sampling_level="seq")
    with pytest.raises(ValueError, match=r"advantages must be \[N\]=2 or \[N, T\]=\(2, 3\), got \(3,\)"):
        policy_loss(x, x, torch.zeros(3), x.bool())
    with pytest.raises(ValueError, match="same"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), x.bool())


def test_an_answer_without_tokens_adds_nothing_at_every_level():
    """Found by review: GSPO counted an all-masked answer as -A_i (its ratio, of no tokens, is 1)."""
    logp = torch.randn(2, 4)
    mask = torch.tensor([[True, True, False, False], [False] * 4])
    adv = torch.tensor([0.0, 2.5])
    for level in ("token", "sequence", "sequence_token"):
        loss, _ = policy_loss(logp, logp, adv, mask, importance_sampling_level=level)
        assert loss.item() == 0.0, level


def test_low_precision_inputs_are_computed_in_float32():
    """bf16 log-probs: |o_i| counted exactly (257, not 256) and GSPO's clip band resolved (a sequence ratio of 1.002
    is clipped, no gradient), as with the same values in float32; -inf at padding gives no NaN."""
    T = 257
    mask = torch.ones(1, T, dtype=torch.bool)
    zero = torch.zeros(1, T, dtype=torch.bfloat16)
    loss, _ = policy_loss(zero, zero, torch.ones(1), mask)
    assert loss.item() == -1.0
    logp = torch.full((1, 8), 0.002, dtype=torch.bfloat16, requires_grad=True)
    old = torch.zeros(1, 8, dtype=torch.bfloat16)
    loss, m = policy_loss(
        logp, old, torch.ones(1), torch.ones(1, 8, dtype=torch.bool), importance_sampling_level="sequence"
    )
    loss.backward()
    assert m["clip_ratio/high_mean"] == 1.0 and logp.grad.abs().sum() == 0
    padded = torch.tensor([[-0.5, float("-inf")]], requires_grad=True)
    for level in ("token", "sequence", "sequence_token"):
        loss, _ = policy_loss(
            padded, padded.detach(), torch.ones(1), torch.tensor([[True, False]]), importance_sampling_level=level
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(padded.grad).all(), level


@pytest.mark.parametrize("low, high", [(0.2, -0.5), (1.0, 0.2), (-0.1, 0.2)])
def test_an_empty_or_inverted_clip_band_is_refused(low, high):
    with pytest.raises(ValueError, match=f"epsilon_low={low}, epsilon_high={high}"):
        policy_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), epsilon_low=low, epsilon_high=high
        )
