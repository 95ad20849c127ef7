"""RoutingReplayGRPOTrainer at the edges of generation: end tokens that generate and TRL disagree on, completions TRL
masks as truncated, a group-limited model family whose live picks are not compared (each found by review), and rows
reordered without their routes."""

from __future__ import annotations

import pytest
import torch
from trl_utils import Spy, agreement, make, swapped_a_near_tie, tiny_policy

from moe_replay.errors import ReplayError
from moe_replay.integrations.trl.trainer import MASK


def test_an_extra_stop_token_is_refused_where_trl_would_not_cut_there_and_trains_where_it_does(tmp_path):
    """generation_kwargs' eos_token_id stops rows at a token TRL does not cut completions at: TRL would train on the
    padding generate fed after it, which no routes cover (found by review: refused at the first batch with a
    message about alignment). Set in the model's generation config, TRL cuts there too, and replay trains."""
    stops = {"eos_token_id": [1, 7], "sequence_bias": {(1,): 2.5, (7,): 2.5}}
    with pytest.raises(
        ValueError, match=r"generate stops rows at end tokens \[1, 7\].* cuts completions only at \[1\]"
    ):
        make(tmp_path / "a", "rollout", generation_kwargs=stops)
    model = tiny_policy()
    model.generation_config.eos_token_id = [1, 7]
    trainer = make(tmp_path / "b", "rollout", model=model, generation_kwargs={"sequence_bias": stops["sequence_bias"]})
    trainer.train()
    assert len(trainer.used) == 2 and all(replayed.mask.any() for replayed, _ in trainer.used)


def test_fewer_stop_tokens_in_generate_than_trl_cuts_at_train_with_the_routes_before_the_cut(tmp_path):
    """generate stops rows at EOS 1 alone (generation_kwargs) while TRL cuts completions at 1 and 7 (the model's
    generation config): generate runs on past a 7, and the routes after TRL's cut are dropped (found by review:
    refused at the first batch with an alignment error). The routes kept are each row's own, up to its cut."""
    model = tiny_policy()
    model.generation_config.eos_token_id = [1, 7]
    stops = {"eos_token_id": 1, "sequence_bias": {(1,): 1.0, (7,): 2.5}}
    trainer = make(tmp_path, "rollout", model=model, generation_kwargs=stops)
    trainer.train()
    cut_at_7 = 0
    for gen in trainer.generated:
        last = gen["completion_mask"].sum(1) - 1
        kept_last = gen["completion_ids"][torch.arange(len(last)), last]
        cut_at_7 += int(((kept_last == 7) & (last < 7)).sum())  # TRL cut there; generate ran on
        assert agreement(gen) == 1.0
        assert agreement(gen, shift=1) < 0.5
        # routes reach each row's last kept token's position (not past it): prompt start .. cut - 1
        positions = gen[MASK].sum(1)
        assert torch.equal(positions, gen["prompt_mask"].sum(1) + gen["completion_mask"].sum(1) - 1)
    assert cut_at_7 > 0
    assert len(trainer.used) == 2
    for replayed, used in trainer.used:
        m = replayed.mask
        assert m.any() and torch.equal(used.mask & m, m)
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])


def test_truncated_completions_masked_by_trl_route_live_and_are_not_counted_as_mismatch(tmp_path):
    """mask_truncated_completions=True zeroes a truncated row's completion in TRL's attention mask: its positions route
    live, and the mismatch metrics at the sampling weights stay 0 (found by review: 5% reported, all of it the routing
    that masking those positions changed)."""
    trainer = make(tmp_path, "rollout", mask_truncated_completions=True, max_completion_length=4, max_steps=1)
    trainer.train()
    row = trainer.state.log_history[0]
    assert row["completions/clipped_ratio"] > 0  # some rows were truncated, and masked
    if not any(swapped_a_near_tie(gen) for gen in trainer.generated):  # (else float noise swapped a near-tie: > 0)
        assert row["routing/mismatch/fraction"] == 0 and row["routing/routes_moved_since_rollout"] == 0
    for gen in trainer.generated:
        attended = torch.cat([gen["prompt_mask"], gen["completion_mask"]], 1).bool()
        assert not (gen[MASK] & ~attended).any()


def test_group_limited_routers_replay_and_say_why_the_routing_metrics_are_missing(tmp_path):
    """A DeepSeek-V3 policy (group-limited routing) replays, but its live picks are not compared: the routing metrics
    are missing from the logs, and a warning says why, once (found by review: they vanished without a word)."""
    from moe_replay.tiny import tiny_moe

    model = tiny_moe(
        0, model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, pad_token_id=0,
    )  # fmt: skip
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    trainer = make(tmp_path, "rollout", model=model)
    with pytest.warns(UserWarning, match="routing/.* is not logged: no replayed router call compared") as caught:
        trainer.train()
    assert sum("is not logged" in str(w.message) for w in caught) == 1
    assert not any(k.startswith("routing/") for row in trainer.state.log_history for k in row)
    for replayed, used in trainer.used:  # the replay itself ran
        m = replayed.mask
        assert m.any() and torch.equal(
            used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m]
        )


class Reordered(Spy):
    """A subclass that reverses the rows of TRL's batch but leaves the routes' keys as they were."""

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        out = super()._generate_and_score_completions(inputs)
        routing = ("routing_indices", "routing_mask", "routing_tokens")
        for key, value in out.items():
            if torch.is_tensor(value) and value.dim() and value.shape[0] > 1 and key not in routing:
                out[key] = value.flip(0)
        return out


def test_rows_reordered_without_their_routes_are_refused(tmp_path):
    """Before, this trained on other rows' experts: visible only as routes_moved_since_rollout ~0.6 instead of 0."""
    trainer = make(tmp_path, "rollout", cls=Reordered, max_steps=1)
    with pytest.raises(ReplayError, match="recorded for other tokens than rows .* reordered or replaced"):
        trainer.train()
