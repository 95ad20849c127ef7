"""RoutingReplayGRPOTrainer against the real TRL GRPOTrainer on a tiny MoE (CPU): plain TRL when off, the replayed
experts really used, bit-exact old log-probs, alignment under padding / EOS / shuffling, checkpointing, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from trl_utils import (
    Spy,
    agreement,
    config,
    logged,
    make,
    prompts,
    reward,
    same_routes_before,
    swapped_a_near_tie,
    tiny_policy,
)

from moe_replay.errors import ReplayError
from moe_replay.integrations.trl import RoutingReplayGRPOTrainer
from moe_replay.integrations.trl.trainer import INDICES
from moe_replay.tiny import tiny_tokenizer

from trl import GRPOTrainer  # isort: skip


def params(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def test_off_is_exactly_plain_trl(tmp_path):
    """routing_replay=None: the same losses, rewards, metrics and weights as trl.GRPOTrainer with the same seed."""
    kw = dict(model=tiny_policy(), reward_funcs=reward, args=config(tmp_path / "a"), train_dataset=prompts())
    plain = GRPOTrainer(**kw, processing_class=tiny_tokenizer())
    plain.train()
    ours = make(tmp_path / "b", None, cls=RoutingReplayGRPOTrainer)
    ours.train()
    assert logged(plain) == logged(ours)
    a, b = params(plain), params(ours)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["rollout", "old_logprob"])
def test_loss_forwards_use_the_replayed_experts(tmp_path, mode):
    """Every loss forward uses exactly the replayed experts, with left padding, early EOS, pad_to_multiple_of=8,
    steps_per_generation > gradient_accumulation_steps (TRL shuffles and splits the generation) and 2 iterations;
    the routes are the ones of their rows, and replayed old log-probs equal live ones bit for bit (fp32)."""
    trainer = make(tmp_path, mode, steps_per_generation=2, pad_to_multiple_of=8, max_steps=3)
    trainer.train()
    assert len(trainer.used) == 3 * 1  # one loss forward per training step (gradient_accumulation_steps=1)
    for replayed, used in trainer.used:
        assert replayed.mask.any()
        assert torch.equal(used.mask & replayed.mask, replayed.mask)
        m = replayed.mask
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])
    lengths = []
    for gen in trainer.generated:
        assert gen["input_ids"].shape[1] % 8 == 0
        lengths += gen["completion_mask"].sum(1).tolist()
        assert (gen["prompt_mask"] == 0).any()  # left padding happened
        # the routes of each row are that row's, after TRL's shuffle and split: they agree with a live forward of
        # the row wherever it has no near-tie; one position of shift would not
        assert agreement(gen) == 1.0
        assert agreement(gen, shift=1) < 0.5
        # old log-probs replayed bit for bit where every earlier route is the live one (all, unless a near-tie swapped)
        ok = same_routes_before(gen) & gen["completion_mask"].bool()
        assert ok.any() and torch.equal(gen["old_per_token_logps"][ok], gen["live_logps"][ok])
    assert min(lengths) < 8 and max(lengths) == 8  # early EOS and a full-length completion in one run


def test_trls_default_bf16_autocast_loss_forwards_use_the_replayed_experts(tmp_path):
    """Under TRL's default precision (bf16=True: accelerate runs the forward in bf16 autocast; the other tests turn it
    off so that routes can be compared with a live forward), every loss forward uses exactly the replayed experts."""
    trainer = make(tmp_path, "rollout", bf16=True, max_steps=2)
    trainer.train()
    assert len(trainer.used) == 2
    for replayed, used in trainer.used:
        m = replayed.mask
        assert m.any() and torch.equal(used.mask & m, m)
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])
    for gen in trainer.generated:  # bf16 really ran: the router logits are bf16 numbers (in fp32 they are not)
        assert all(torch.equal(x, x.bfloat16().float()) for x in gen["router_logits"])


def test_checkpointing_on_and_off_train_identically(tmp_path):
    runs = []
    for gc in (True, False):
        t = make(tmp_path / str(gc), "rollout", gradient_checkpointing=gc, cls=RoutingReplayGRPOTrainer)
        t.train()
        runs.append((logged(t), params(t)))
    (log_a, p_a), (log_b, p_b) = runs
    assert [r.get("loss") for r in log_a] == [r.get("loss") for r in log_b]
    assert all(torch.equal(p_a[k], p_b[k]) for k in p_a)


def test_rollout_and_old_logprob_train_identically_when_their_routes_agree(tmp_path):
    """In fp32 the routes recorded under generate and in the old-log-prob pass agree here (checked first); then R3
    and R2 train to the same weights. routing/ metrics are logged and move once the policy has been updated."""
    r3 = make(tmp_path / "r3", "rollout", max_steps=4)
    r3.train()  # each trainer seeds the global RNG when it is made: make and train one, then the other
    if any(swapped_a_near_tie(gen) for gen in r3.generated):  # (agreeing everywhere else: checked)
        pytest.skip("float noise swapped a near-tie between generate and a full forward on this machine: R2 and R3 "
                    "replay other experts there, so they do not train identically")  # fmt: skip
    r2 = make(tmp_path / "r2", "old_logprob", max_steps=4)
    r2.train()
    for a, b in zip(r3.generated, r2.generated, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
        m = a["routing_mask"]
        assert torch.equal(m, b["routing_mask"])
        assert torch.equal(a[INDICES].long().sort(-1).values[m], b[INDICES].long().sort(-1).values[m])
    pa, pb = params(r3), params(r2)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    moved = [row["routing/routes_moved_since_rollout"] for row in r3.state.log_history if "loss" in row]
    assert moved[0] == 0.0 and max(moved) > 0.0  # first update at the sampling weights, then live routing moves
    assert [row.get("routing/mismatch/fraction") for row in r3.state.log_history if "reward" in row][0] == 0.0
    assert "routing/routes_moved_since_rollout" in r2.state.log_history[0]


def test_separate_reference_model_routes_live(tmp_path):
    """beta != 0 with a reference model loaded from disk: it is never taken for the policy."""
    tiny_policy().save_pretrained(tmp_path / "policy")
    trainer = make(tmp_path, "rollout", model=str(tmp_path / "policy"), beta=0.1, max_steps=1)
    trainer.model.generation_config.eos_token_id = 1
    trainer.train()
    assert trainer.ref_model is not None and not trainer._is_policy(trainer.ref_model)
    assert trainer._is_policy(trainer.model)
    assert trainer.state.log_history[0]["kl"] >= 0.0


class PeftRef(Spy):
    """Also computes the adapter-disabled reference log-probs live (no replay) after each generation."""

    def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
        from trl.trainer.utils import use_adapter

        out = super()._generate_and_score_completions(inputs)
        gen = self.generated[-1]
        with torch.no_grad(), use_adapter(self._core(self.model), None):
            assert not self._is_policy(self.model)
            gen["live_ref"] = GRPOTrainer._get_per_token_logps_and_entropies(
                self,
                self.model,
                gen["input_ids"],
                torch.cat([out["prompt_mask"], out["completion_mask"]], 1),
                out["completion_ids"].shape[1],
            )[0]
            gen["ref_routes"] = teacher_forced(self, gen)
        assert self._is_policy(self.model)
        return out


def teacher_forced(trainer, gen):  # noqa: ANN001, ANN201
    from moe_replay import record_routes

    with record_routes(trainer._core(trainer.model)) as rec:
        trainer.model(gen["input_ids"], attention_mask=(gen["input_ids"] != 0).long())
    return rec.routes


def peft_ref(tmp_path, max_steps: int, **lora: Any) -> PeftRef:  # noqa: ANN001
    """A `PeftRef` trainer (beta 0.1, R3) with LoRA on q/v and `lora`'s further LoraConfig settings."""
    from peft import LoraConfig

    return PeftRef(
        model=tiny_policy(),
        reward_funcs=reward,
        args=config(tmp_path, beta=0.1, max_steps=max_steps, learning_rate=0.1),
        train_dataset=prompts(),
        processing_class=tiny_tokenizer(),
        routing_replay="rollout",
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **lora),
    )


def test_peft_reference_routes_live(tmp_path):
    """PEFT with beta != 0: the reference is the same model with its adapter disabled. Its log-probs are computed
    live even where the policy's replayed routes differ from the reference's own."""
    trainer = peft_ref(tmp_path, max_steps=6, lora_alpha=8)
    trainer.train()
    differ = 0
    for gen in trainer.generated:
        m = gen["completion_mask"]
        assert torch.equal(gen["ref_per_token_logps"] * m, gen["live_ref"] * m)
        ref, pol = gen["ref_routes"], gen["live_routes"]
        differ += int((ref.indices.sort(-1).values != pol.indices.sort(-1).values)[ref.mask & pol.mask].sum())
    assert differ > 0  # the policy routes some tokens elsewhere than the reference: replaying it would show


@pytest.mark.parametrize("target", ["gate", "mlp"])
def test_routers_trained_in_full_beside_lora_replay(tmp_path, target):
    """PEFT `modules_to_save` (the routers, or the MoE blocks) beside LoRA, beta != 0: every loss forward uses the
    replayed experts on the trained copies, the adapter-disabled reference routes live on the frozen originals, and
    the trained copies' routers learn while the originals stay as they were."""
    trainer = peft_ref(tmp_path, max_steps=3, modules_to_save=[target])
    before = params(trainer)
    trainer.train()
    assert len(trainer.used) == 3
    for replayed, used in trainer.used:
        m = replayed.mask
        assert m.any() and torch.equal(
            used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m]
        )
    for gen in trainer.generated:
        m = gen["completion_mask"]
        assert torch.equal(gen["ref_per_token_logps"] * m, gen["live_ref"] * m)
    after = params(trainer)
    routers = [k for k in before if ".gate." in k and k.endswith(".weight")]  # (either target: ...mlp.gate...)
    copies = [k for k in routers if "modules_to_save" in k]
    originals = [k for k in routers if "original_module" in k]
    assert copies and originals
    assert all(not torch.equal(before[k], after[k]) for k in copies)
    assert all(torch.equal(before[k], after[k]) for k in originals)


class Shifted(Spy):
    """Routes recorded under generate, moved one position to the right (a classic off-by-one)."""

    def _generate_single_turn(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = super()._generate_single_turn(*args, **kwargs)
        routes, p, c = self._rr_turns[-1]
        from moe_replay import Routes

        shifted = Routes(routes.indices.roll(1, 1), routes.mask.roll(1, 1), routes.layers)
        self._rr_turns[-1] = (shifted, p, c)
        return out


def test_a_one_position_shift_is_an_error(tmp_path):
    trainer = make(tmp_path, "rollout", cls=Shifted)
    with pytest.raises(ReplayError, match="do not line up with TRL's row"):
        trainer.train()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(use_vllm=True), "use_vllm"),
        (dict(use_transformers_continuous_batching=True), "continuous_batching"),
        (dict(num_iterations=1), "nothing to replay.*num_iterations=1"),
    ],
)
def test_refused_settings(tmp_path, kw, match):
    mode = "old_logprob" if "num_iterations" in kw else "rollout"
    with pytest.raises(ValueError, match=match):
        make(tmp_path, mode, **kw)


@pytest.mark.parametrize(
    "extra, match",
    [
        (dict(tools=[lambda x: x], rollout_func=lambda prompts, trainer: {}), "tools together with a rollout_func"),
        (dict(environment_factory=object, rollout_func=lambda prompts, trainer: {}), "environment_factory together"),
    ],
)
def test_refused_arguments(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        RoutingReplayGRPOTrainer(
            model=tiny_policy(),
            reward_funcs=reward,
            args=config(tmp_path),
            train_dataset=prompts(),
            processing_class=tiny_tokenizer(),
            routing_replay="rollout",
            **extra,
        )


def test_bad_mode_and_images_are_refused(tmp_path):
    with pytest.raises(ValueError, match="routing_replay must be one of"):
        make(tmp_path, "R3")
    trainer = make(tmp_path, "rollout")
    with pytest.raises(ValueError, match="multimodal"):
        trainer._generate_and_score_completions([{"prompt": "1+2=", "image": None}])


def test_layout_checks_name_both_sides():
    from moe_replay import LayerInfo, Routes
    from moe_replay.integrations.trl import check_tokens, recorded_span, routes_for_batch

    with pytest.raises(ReplayError, match="row 0, position 3 holds token 9 but generation gave 7"):
        check_tokens(torch.tensor([[0, 5, 6, 9, 0]]), [[5, 6]], [[7]], prompt_width=3)
    # generate: prompt width 3, completions of 2 and 1 tokens -> T = 5; TRL pads the batch to width 8 (prompts 4)
    span = recorded_span([2, 3], [2, 1], prompt_width=3, width=5)
    routes = Routes(torch.zeros(2, 5, 1, 1, dtype=torch.uint8), span, [LayerInfo("l0", 2, 1)])
    ids = torch.tensor([[0, 0, 5, 6, 7, 1, 0, 0], [0, 5, 6, 8, 1, 0, 0, 0]])
    rows = routes_for_batch(routes, [[5, 6], [5, 6, 8]], [[7, 1], [1]], ids, completion_width=4)
    assert rows.mask.int().tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]]
    shifted = Routes(routes.indices, span.roll(1, 1), routes.layers)
    with pytest.raises(ReplayError, match=r"do not line up with TRL's row 0: they cover positions 2..4 but .* 1..3"):
        routes_for_batch(shifted, [[5, 6], [5, 6, 8]], [[7, 1], [1]], ids, completion_width=4)
    # generate ran on past TRL's cut of row 1 (T = 6): the route after it is dropped; ending before the cut is refused
    longer = recorded_span([2, 3], [3, 3], prompt_width=3, width=6)
    routes = Routes(torch.zeros(2, 6, 1, 1, dtype=torch.uint8), longer, [LayerInfo("l0", 2, 1)])
    ids = torch.tensor([[0, 0, 5, 6, 7, 1, 4, 0], [0, 5, 6, 8, 1, 0, 0, 0]])
    rows = routes_for_batch(routes, [[5, 6], [5, 6, 8]], [[7, 1, 4], [1]], ids, completion_width=4)
    assert rows.mask.int().tolist() == [[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]]
    short = Routes(torch.zeros(2, 7, 1, 1, dtype=torch.uint8), recorded_span([2, 3], [3, 1], 3, 7), routes.layers)
    ids = torch.tensor([[0, 0, 5, 6, 7, 1, 4, 2, 0], [0, 5, 6, 8, 1, 0, 0, 0, 0]])
    with pytest.raises(ReplayError, match=r"TRL's row 0: they cover positions 1..4 but .* need 1..5"):
        routes_for_batch(short, [[5, 6], [5, 6, 8]], [[7, 1, 4, 2], [1]], ids, completion_width=5)
    ids = ids[:, :8]
    with pytest.raises(ReplayError, match=r"generate recorded T=6 positions but .* left-padded to 8, .* need 11"):
        routes_for_batch(routes, [[5, 6], [5, 6, 8]], [[7, 1, 4], [1]], ids, 4, pad_to_multiple_of=8)


def test_gradient_accumulation_and_evaluation(tmp_path):
    """gradient_accumulation_steps=2 (one replay per micro-batch, each open through its backward) and evaluation
    (prediction_step replays without a backward): every loss forward uses the replayed experts; eval metrics logged."""
    trainer = Spy(
        model=tiny_policy(),
        reward_funcs=reward,
        args=config(
            tmp_path,
            gradient_accumulation_steps=2,
            eval_strategy="steps",
            eval_steps=1,
            per_device_eval_batch_size=4,
            num_generations_eval=2,
        ),
        train_dataset=prompts(),
        eval_dataset=prompts(8),
        processing_class=tiny_tokenizer(),
        routing_replay="rollout",
    )
    trainer.train()
    assert len(trainer.used) >= 2 * 2 + 2  # 2 steps x 2 micro-batches, and the evaluations' forwards
    for replayed, used in trainer.used:
        m = replayed.mask
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])
    assert any("eval_routing/routes_moved_since_rollout" in row for row in trainer.state.log_history)
