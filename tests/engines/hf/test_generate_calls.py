"""`generate` as users call it and the rows it records: rows end at their EOS (one id or several; given as an
argument, positionally in a generation config, in a passed `generation_config` that sets none or in the model's own
config, also under a wrapper module whose `generate` calls its model's), a chunked prefill is one prompt, and a
generate that raised midway records nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, Delegating, extend_mask, left_padded, near_ties, sampled, tiny_qwen3_moe
from torch import nn
from transformers import GenerationConfig

from moe_replay import record_routes


def sampled_mask(target: nn.Module, call) -> torch.Tensor:  # noqa: ANN001
    torch.manual_seed(0)
    with torch.no_grad(), record_routes(target) as rec:
        call(target)
    return rec.routes.mask


@pytest.mark.parametrize("eos", [7, [11, 7]], ids=["one_eos", "two_eos"])
def test_rows_end_at_their_eos_token(eos):
    model = tiny_qwen3_moe(seed=4)
    ids, mask = left_padded(6, 4, [0, 1, 0, 2, 0, 0], seed=4)
    with torch.no_grad():  # make EOS likely so some rows stop early
        model.lm_head.weight[eos] += 0.3
    torch.manual_seed(0)
    out, routes = sampled(model, ids, mask, 8, exact=False, eos_token_id=eos)
    seq = out.sequences
    finished = 0
    for b in range(seq.shape[0]):
        hits = torch.isin(seq[b, 4:], torch.tensor(eos)).nonzero()
        end = 4 + int(hits[0]) if len(hits) else seq.shape[1] - 1
        finished += bool(len(hits)) and end < seq.shape[1] - 1
        # recorded: real prompt tokens and generated tokens before the row's last sampled one (its EOS)
        assert routes.mask[b, :end].tolist() == mask[b].bool().tolist() + [True] * (end - 4)
        assert not routes.mask[b, end:].any()
    assert finished > 0  # some row stopped before the others: the check above covered post-EOS padding


def test_rows_end_at_the_eos_of_a_positional_config_or_of_the_model_under_a_wrapper(qwen):
    """The end-of-sequence id that stops rows is the one the innermost generate ran with: given positionally, or in
    the model's config under a wrapper; positions after a row's EOS are then unrecorded as on the bare model."""
    ids, mask = left_padded(3, 6, [0, 2, 1], seed=1)
    sampling = {"max_new_tokens": 8, "do_sample": True, "pad_token_id": PAD}
    torch.manual_seed(0)
    with torch.no_grad():
        out = qwen.generate(ids, attention_mask=mask, **sampling)
    eos = int(out[0, 8])  # a token row 0 samples (seed 0 below): it ends there
    config = GenerationConfig(eos_token_id=eos, **sampling)
    expected = sampled_mask(
        qwen, lambda m: m.generate(input_ids=ids, attention_mask=mask, eos_token_id=eos, **sampling)
    )
    assert not expected[0, 8:].any()
    assert torch.equal(sampled_mask(qwen, lambda m: m.generate(ids, config, attention_mask=mask)), expected)
    before = qwen.generation_config.eos_token_id
    qwen.generation_config.eos_token_id = eos
    try:
        got = sampled_mask(Delegating(qwen), lambda m: m.generate(input_ids=ids, attention_mask=mask, **sampling))
    finally:
        qwen.generation_config.eos_token_id = before
    assert torch.equal(got, expected)


def test_generation_config_passed_without_eos_ends_rows_at_the_models_eos(qwen):
    """A `generation_config` passed to generate leaves unset what it does not set: transformers fills EOS from the
    model's, and stops there, so the routes end there too."""
    from transformers import GenerationConfig

    ids, mask = left_padded(2, 5, [0, 1])
    sampling = {"do_sample": True, "max_new_tokens": 8, "pad_token_id": PAD}
    torch.manual_seed(0)
    with torch.no_grad():
        eos = int(qwen.generate(input_ids=ids, attention_mask=mask, **sampling)[0, 7])  # row 0's third new token
    qwen.generation_config.eos_token_id = eos
    masks = []
    for kw in (sampling, {"generation_config": GenerationConfig(**sampling)}):
        torch.manual_seed(0)
        with torch.no_grad(), record_routes(qwen) as rec:
            qwen.generate(input_ids=ids, attention_mask=mask, **kw)
        masks.append(rec.routes.mask)
    assert not masks[0][0, 7:].any() and torch.equal(masks[1], masks[0])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_chunked_prefill_is_one_prompt(qwen, cache):
    """generate(prefill_chunk_size=...) runs the prompt in several forwards; out.sequences still starts with the
    whole prompt: an EOS id inside it (a chat template's turn end) ends no row, and its padding is not recorded."""
    ids, mask = left_padded(2, 12, [0, 3])
    ids[:, 8] = 7
    sampling = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": True, "pad_token_id": PAD, "eos_token_id": 7}
    if cache == "static":
        sampling["cache_implementation"] = "static"
    masks = []
    for chunk in ({}, {"prefill_chunk_size": 4}):
        torch.manual_seed(0)
        with torch.no_grad(), record_routes(qwen) as rec:
            qwen.generate(input_ids=ids, attention_mask=mask, **sampling, **chunk)
        masks.append(rec.routes.mask)
    assert torch.equal(masks[1], masks[0]) and masks[0][:, 9:12].all() and not masks[0][1, :3].any()


def test_a_generate_that_raises_midway_records_nothing_and_its_retry_is_recorded_alone(qwen):
    """A generate that raised after some decode steps (an OOM, an interrupt, a logits processor's error) is not
    recorded: a retry in the same context gives one batch, the retry's."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Boom(LogitsProcessor):
        def __init__(self, at: int) -> None:
            self.left = at

        def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.left -= 1
            if self.left == 0:
                raise RuntimeError("out of memory (simulated)")
            return scores

    ids, mask = left_padded(2, 5, [0, 1])
    sampling = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": True, "pad_token_id": PAD}
    torch.manual_seed(3)
    with torch.no_grad(), record_routes(qwen) as alone:
        expected = qwen.generate(input_ids=ids, attention_mask=mask, **sampling)
    for at in (1, 5):  # after the prefill (handed to the recorder at once), after decode steps (held by the hub)
        with torch.no_grad(), record_routes(qwen) as rec:
            with pytest.raises(RuntimeError, match="simulated"):
                qwen.generate(
                    input_ids=ids, attention_mask=mask, logits_processor=LogitsProcessorList([Boom(at)]), **sampling
                )
            torch.manual_seed(3)
            assert torch.equal(qwen.generate(input_ids=ids, attention_mask=mask, **sampling), expected)
        assert len(rec.batches) == 1 and rec.routes.equal(alone.routes)


def test_generate_in_training_mode_with_gradient_checkpointing_records_what_a_full_forward_routes_or_is_refused(qwen):
    """transformers 5.19 turns the KV cache off inside a training-mode forward with gradient checkpointing, so
    generate's decode steps see only their own token (found on the floor transformers: the routes were those of that
    broken generation, no error); 5.25 keeps the cache. Either the routes are a full forward's, or the generate is
    refused."""
    from moe_replay import UnsupportedGenerationError

    ids, mask = left_padded(2, 5, [0, 2])
    qwen.gradient_checkpointing_enable()
    qwen.train()
    torch.manual_seed(0)
    try:
        with torch.no_grad(), record_routes(qwen) as rec:
            out = qwen.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=4,
                                return_dict_in_generate=True, pad_token_id=PAD)  # fmt: skip
    except UnsupportedGenerationError as e:
        assert "KV cache is still empty after forwards of 5 positions" in str(e)
        return
    qwen.eval()
    with torch.no_grad(), record_routes(qwen) as tf:
        full = extend_mask(mask, out.sequences.shape[1])
        logits = qwen(out.sequences, attention_mask=full, output_router_logits=True).router_logits
    got, ties = rec.routes, near_ties(logits, 2, out.sequences.shape)
    assert got.mask.sum() == 2 * 8 - 2
    same = (got.indices.sort(-1).values == tf.routes.indices.sort(-1).values).all(-1)  # [B, T, L]
    compared = got.mask[..., None] & ~ties  # (near-ties of the full forward left out: helpers.near_ties)
    assert compared.any() and same[compared].all()
