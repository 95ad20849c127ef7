"""TRL's `rollout_func` with routes: a user's own rollout (here HF `generate`, its routes handed over in vLLM 0.33's
exact server encoding: base64 `.npy`, with `prompt_start`) trains under `RoutingReplayGRPOTrainer`; every loss
forward uses the experts the rollout recorded; bad routes, R2 with routes, and `use_vllm` without a rollout_func
are refused."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
import torch
from trl_utils import Spy, agreement, config, prompts, reward, same_routes_before, sampling_mode, tiny_policy

from moe_replay import LayerInfo, Routes, Segment, assemble_routes, record_routes
from moe_replay.errors import ReplayError
from moe_replay.integrations.trl.rollout import left_padded, taking_routes
from moe_replay.integrations.trl.trainer import MASK, refuse_settings
from moe_replay.integrations.vllm import routes_from_vllm
from moe_replay.tiny import tiny_tokenizer

EOS, PAD, DECODER_LAYERS, MOE_COLUMNS = 1, 0, 3, [0, 2]


def engine_rollout(prompt_start: int = 0, corrupt: str | None = None):  # noqa: ANN201
    """A rollout_func that samples with HF `generate` (one completion per prompt, TRL's cut at the first EOS), and
    returns the routes as vLLM 0.33's server returns them, imported with `routes_from_vllm`."""

    def rollout(batch_prompts: list[str], trainer: Any) -> dict[str, Any]:
        tok, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model)
        prompt_ids = [tok(p)["input_ids"] for p in batch_prompts]
        width = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompt_ids])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompt_ids])[:, None]).long()
        with torch.no_grad(), sampling_mode(model), record_routes(model) as rec:
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=8,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=PAD,
                                 eos_token_id=EOS, sequence_bias={(EOS,): 2.5})  # fmt: skip
        logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
        responses, completion_ids, logprobs = [], [], []
        for i, p in enumerate(prompt_ids):
            new = out.sequences[i, width:].tolist()
            c = new[: new.index(EOS) + 1] if EOS in new else new
            completion_ids.append(c)
            logprobs.append([float(logp[i, t, tok_id]) for t, tok_id in enumerate(c)])
            n = len(p) + len(c) - 1  # vLLM: [prompt + completion - 1 - prompt_start, decoder layers, K]
            pad = width - len(p)
            moe = rec.routes.indices[i, pad + prompt_start : pad + n].numpy()
            rows = np.zeros((moe.shape[0], DECODER_LAYERS, moe.shape[2]), dtype=np.uint8)
            rows[:, MOE_COLUMNS] = moe
            if corrupt == "short":
                rows = rows[:-1]
            buf = io.BytesIO()
            np.save(buf, rows)
            choice = {"index": 0, "token_ids": c, "routed_experts": base64.b64encode(buf.getvalue()).decode()}
            responses.append({"prompt_token_ids": p, "choices": [choice]})
        routes = routes_from_vllm(responses, model, prompt_start=prompt_start)  # ("short": raises, naming the row)
        output = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
        if corrupt != "missing":
            output["routes"] = routes
        if corrupt == "rows":
            output["routes"] = routes[[0]]
        if corrupt == "swapped":  # two rows' routes exchanged (each row still fits the other's lengths or not)
            order = list(range(routes.batch_size))
            order[0], order[1] = 1, 0
            output["routes"] = routes[order]
        return output

    return rollout


def make(tmp_path, mode="rollout", rollout=None, **kw):  # noqa: ANN001, ANN003, ANN201
    return Spy(model=tiny_policy(), reward_funcs=reward, args=config(tmp_path, **kw), train_dataset=prompts(),
               processing_class=tiny_tokenizer(), routing_replay=mode,
               rollout_func=rollout if rollout is not None else engine_rollout())  # fmt: skip


@pytest.mark.parametrize("prompt_start", [0, 2])
def test_a_rollout_funcs_engine_routes_are_the_ones_every_loss_forward_uses(tmp_path, prompt_start):
    trainer = make(tmp_path, rollout=engine_rollout(prompt_start), max_steps=2)
    trainer.train()
    assert trainer.used and all(r.mask.any() for r, _ in trainer.used)
    for replayed, used in trainer.used:
        m = replayed.mask
        assert torch.equal(used.mask & m, m)
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])
    for gen in trainer.generated:
        # each row's routes are its own (a live forward of the row agrees; one position of shift does not)
        assert agreement(gen) == 1.0
        assert agreement(gen, shift=1) < 0.5
        first = gen["prompt_mask"].long().argmax(1)  # each row's first prompt token
        rows = torch.arange(len(first))
        for offset in range(prompt_start):  # the positions the engine skipped are unrecorded: they route live
            assert not gen[MASK][rows, first + offset].any()
        assert gen[MASK][rows, first + prompt_start].all()
        ok = same_routes_before(gen) & gen["completion_mask"].bool()  # (R3 in fp32: replayed old log-probs are live)
        assert ok.any() and torch.equal(gen["old_per_token_logps"][ok], gen["live_logps"][ok])


def test_bad_rollout_routes_and_unsupported_combinations_are_refused(tmp_path):
    with pytest.raises(ReplayError, match="needs the rollout_func to return 'routes'"):
        make(tmp_path / "a", rollout=engine_rollout(corrupt="missing")).train()
    with pytest.raises(ValueError, match="routes for 1 rows but 4 completions"):
        make(tmp_path / "b", rollout=engine_rollout(corrupt="rows")).train()
    with pytest.raises(ValueError, match="vLLM output 0, completion 0, routed_experts: routes hold"):
        make(tmp_path / "c", rollout=engine_rollout(corrupt="short")).train()
    # two rows' routes swapped (found by review: with rows of equal length they passed every check); the importer's
    # routes know each row's tokens
    with pytest.raises(ValueError, match=r"the rollout_func's 'routes': row 0 was imported for other tokens than its"):
        make(tmp_path / "s", rollout=engine_rollout(corrupt="swapped")).train()
    with pytest.raises(ValueError, match="R2\\) records its routes in the old-log-prob pass"):
        make(tmp_path / "d", mode="old_logprob", steps_per_generation=2, gradient_accumulation_steps=1).train()
    args = config(tmp_path / "e")
    args.use_vllm = True  # (set after construction: TRL's own check wants vLLM installed)
    with pytest.raises(ValueError, match="needs a rollout_func that returns the routes"):
        refuse_settings(args, "rollout", rollout_func=False)
    refuse_settings(args, "rollout", rollout_func=True)  # allowed: TRL's weight sync to the user's engine
    with pytest.raises(ValueError, match="must be a Routes, got dict"):
        taking_routes(lambda p, t: {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]],
                                    "routes": {}}, "rollout", print)([], None)  # fmt: skip
    ids = torch.tensor([0, 1], dtype=torch.uint8).expand(1, 4, 1, 2)
    routes = Routes(ids.clone(), torch.ones(1, 4, dtype=torch.bool), [LayerInfo("g", 4, 2)])
    with pytest.raises(ValueError, match="record row 0 up to position 3 but it has 1 prompt and 2 completion"):
        left_padded(routes, [[5]], [[6, 7]], None)
    with pytest.raises(ValueError, match=r"record row 0 up to position 3 .* \(routes at positions 0..2\)"):
        left_padded(routes, [[5, 6]], [[7, 8]], None)  # (a route at the last token: shifted by one)


@pytest.mark.parametrize("recorded", [[0, 1, 2, 3], [0, 1], [1, 2, 3], [0, 2, 3, 4], []])
def test_partial_routes_must_be_a_whole_run_ending_at_the_last_input(recorded):
    from moe_replay.integrations.trl.layout import routes_for_batch

    ids = torch.tensor([0, 1], dtype=torch.uint8).expand(1, 6, 1, 2).clone()
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, recorded] = True
    routes = Routes(ids, mask, [LayerInfo("g", 4, 2)])
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])  # 3 prompt and 3 completion tokens: routes at 0..4
    with pytest.raises(ReplayError):
        routes_for_batch(routes, [[5, 6, 7]], [[8, 9, 10]], input_ids, 3, partial=True)
    mask[0] = False
    mask[0, 2:5] = True  # a skipped prefix (prompt_start 2): allowed
    rows = routes_for_batch(Routes(ids, mask, [LayerInfo("g", 4, 2)]), [[5, 6, 7]], [[8, 9, 10]], input_ids, 3,
                            partial=True)  # fmt: skip
    assert rows.mask[0].tolist() == [False, False, True, True, True, False]


def agent_rollout(batch_prompts: list[str], trainer: Any) -> dict[str, Any]:
    """Two turns with tool tokens between them (`env_mask` 0), each turn a `generate` over the whole conversation, the
    routes assembled by the segment rule (`assemble_routes`), in rows that start at position 0."""
    tok, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model)
    convs = [tok(p)["input_ids"] for p in batch_prompts]
    prompt_ids = [list(c) for c in convs]
    segments, env, turns = [], [5, 6], []
    for turn in range(2):
        width = max(len(c) for c in convs)
        ids = torch.tensor([[PAD] * (width - len(c)) + c for c in convs])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(c) for c in convs])[:, None]).long()
        with torch.no_grad(), sampling_mode(model), record_routes(model) as rec:
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=3, min_new_tokens=3,
                                 pad_token_id=PAD, suppress_tokens=[EOS])  # fmt: skip
        new = out[:, width:].tolist()
        full_mask = torch.cat([mask, torch.ones(len(convs), 3, dtype=torch.long)], 1)
        sampled_from = torch.tensor([len(c) - 1 for c in convs])
        segments.append(Segment(rec.routes, full_mask, version=0, sampled_from=sampled_from))
        turns.append(new)
        convs = [c + n + (env if turn == 0 else []) for c, n in zip(convs, new, strict=True)]
    lengths = torch.tensor([len(c) for c in convs])
    rows = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()  # position t = token t of the row
    completion_ids = [c[len(p) :] for c, p in zip(convs, prompt_ids, strict=True)]
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": [[0.0] * len(c) for c in completion_ids],
        "env_mask": [[1, 1, 1, 0, 0, 1, 1, 1] for _ in completion_ids],
        "routes": assemble_routes(segments, rows),
    }


def test_a_multi_turn_rollout_func_with_env_tokens_trains_on_its_assembled_routes(tmp_path):
    trainer = make(tmp_path, rollout=agent_rollout, max_steps=2)
    trainer.train()
    for replayed, used in trainer.used:
        m = replayed.mask
        assert m.any() and torch.equal(used.mask & m, m)
        assert torch.equal(used.indices.long().sort(-1).values[m], replayed.indices.long().sort(-1).values[m])
    for gen in trainer.generated:
        assert (gen["tool_mask"].sum(1) == 6).all()  # the two tool tokens are out of the loss (TRL: tool_mask)
        assert agreement(gen) == 1.0
        assert agreement(gen, shift=1) < 0.5
