"""A tiny TRL GRPO set-up on CPU for the integration tests: a 3-layer Qwen3-MoE, a character tokenizer, prompts of
several lengths (left padding), a reward that varies, and EOS made likely (early EOS, right-padded completions)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from helpers import differ, kept_pairs, near_ties  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from moe_replay import Routes, record_routes  # noqa: E402
from moe_replay.integrations.trl import RoutingReplayGRPOTrainer  # noqa: E402
from moe_replay.integrations.trl.trainer import INDICES, MASK  # noqa: E402
from moe_replay.tiny import tiny_moe, tiny_tokenizer  # noqa: E402

TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def tiny_policy(seed: int = 0) -> torch.nn.Module:
    """3 layers (layer 1 dense), 8 experts, top-2, well-separated routers, EOS id 1, pad id 0."""
    model = tiny_moe(seed, layers=3, experts=8, top_k=2, dense_layers=[1], router_std=0.5, intermediate_size=96)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def prompts(n: int = 16) -> Dataset:
    """Prompts of 4 to 8 characters, so that every generation batch is left-padded."""
    base = [f"{a}+{b}=" for a in (1, 23, 456) for b in (7, 89, 123)]
    return Dataset.from_dict({"prompt": [base[i % len(base)] for i in range(n)]})


def reward(completions: list[str], **_: Any) -> list[float]:
    """Varies with length and content, so that advantages are not all zero."""
    return [c.count("1") + c.count("2") - 0.1 * len(c) for c in completions]


def config(tmp_path: Any, **kw: Any) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        num_iterations=2,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 autocast; fp32 keeps generate and a full forward within ~1e-6 (near_ties)
        learning_rate=3e-2,
        seed=0,
        save_strategy="no",
        beta=0.0,
        disable_tqdm=True,
        generation_kwargs={"sequence_bias": {(1,): 2.5}},  # EOS likely: completions end at different lengths
    )
    base.update(kw)
    return GRPOConfig(**base)


class Spy(RoutingReplayGRPOTrainer):
    """Records what every loss forward really used (a recording nested in the replay), the routes of each
    generation, and the old log-probs against a live (not replayed) forward at the sampling weights."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.used: list[tuple[Routes, Routes]] = []  # (replayed, recorded inside the replay)
        self.generated: list[dict[str, torch.Tensor]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
        with record_routes(self._core(model)) as rec:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.used.append((Routes(inputs[INDICES], inputs[MASK], self._rr_layers), rec.routes))
        return loss

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():
            live = GRPOTrainer._get_per_token_logps_and_entropies(
                self, self.model, ids, mask, out["completion_ids"].shape[1]
            )[0]
            with record_routes(self._core(self.model)) as rec:
                logits = self.model(ids, attention_mask=mask, output_router_logits=True).router_logits
        ties = near_ties(logits, rec.routes.layers[0].top_k, ids.shape)
        live_out = {"live_logps": live, "live_routes": rec.routes, "router_logits": logits, "near_ties": ties}
        self.generated.append({**out, **live_out, "input_ids": ids})
        return out


@contextlib.contextmanager
def sampling_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode for a rollout's generate, its mode restored after (in training mode with gradient
    checkpointing transformers 5.19 runs generate without its KV cache, which moe-replay refuses)."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def sampled(gen: dict[str, Any], shift: int = 0) -> Routes:
    """A generation's routes (`gen[INDICES]` [B, T, L, K] at `gen[MASK]`), moved `shift` positions right."""
    return Routes._trusted(gen[INDICES].roll(shift, 1), gen[MASK].roll(shift, 1), gen["live_routes"].layers)


def agreement(gen: dict[str, Any], shift: int = 0) -> float:
    """Share of the (token, layer) expert sets a generation's routes (optionally moved `shift` positions right) hold
    that equal a live forward's (`gen["live_routes"]`), the live forward's near-ties left out (and, unshifted, what
    follows one that came out otherwise: `helpers.kept_pairs`). The routes of the right rows at the right positions
    agree everywhere (1.0); a misaligned or foreign row disagrees almost everywhere."""
    mine, live = sampled(gen, shift), gen["live_routes"]
    recorded, differing, ties = mine.mask & live.mask, differ(mine, live), gen["near_ties"]
    m = kept_pairs(differing, ties, recorded) if shift == 0 else recorded[..., None] & ~ties
    assert m.any(), "no (token, layer) pair left to compare"
    return float((~differing)[m].float().mean())


def swapped_a_near_tie(gen: dict[str, Any]) -> bool:
    """Whether a generation's routes hold other experts than a live forward's at any pair both recorded, after
    asserting that they agree wherever the live forward has no near-tie (`agreement`): True only where float noise
    swapped a near-tie (rare, and machine-dependent)."""
    assert agreement(gen) == 1.0
    return bool(_moved(gen).any())


def _moved(gen: dict[str, Any]) -> torch.Tensor:
    """bool [B, T]: positions both recorded where the generation's routes and the live forward's differ."""
    return differ(sampled(gen), gen["live_routes"]).any(-1)


def same_routes_before(gen: dict[str, Any]) -> torch.Tensor:
    """bool [B, C]: the completion tokens whose log-prob was computed, in the live forward and under the generation's
    routes alike, from the same experts at every earlier position and layer (all of them, unless float noise swapped
    a near-tie: `agreement`). Where this holds, a replay of the generation's routes gives the live log-probs."""
    C = gen["completion_ids"].shape[1]
    return (_moved(gen).cumsum(1) == 0)[:, -C - 1 : -1]  # completion token c is predicted at position P + c - 1


def make(tmp_path: Any, routing_replay: str | None, cls: type = Spy, model: Any = None, **kw: Any) -> Any:
    return cls(
        model=model if model is not None else tiny_policy(),
        reward_funcs=reward,
        args=config(tmp_path, **kw),
        train_dataset=prompts(),
        processing_class=tiny_tokenizer(),
        routing_replay=routing_replay,
    )


def logged(trainer: Any) -> list[dict[str, float]]:
    """The trainer's log rows without timing fields."""
    return [{k: v for k, v in row.items() if k not in TIMING} for row in trainer.state.log_history]
