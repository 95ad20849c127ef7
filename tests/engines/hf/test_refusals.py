"""What moe-replay refuses rather than record or replay wrongly, one test per refusal: `generate` modes whose routes
it cannot follow (no KV cache, beam search however it is asked for, classifier-free guidance, assisted decoding, a
prompt given as `inputs_embeds`), continuous batching, a model with no router, and a replay given no Routes."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, Delegating, hook_count, left_padded
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

from moe_replay import UnsupportedGenerationError, UnsupportedModelError, record_routes, replay_routes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"use_cache": False}, "use_cache=True"),
        ({"num_beams": 2}, "beam search"),
        ({"guidance_scale": 1.5}, "classifier-free guidance"),
        ({"prompt_lookup_num_tokens": 2}, "assisted decoding"),
    ],
)
def test_generate_modes_that_cannot_be_followed_are_refused(qwen, kwargs, match):
    ids, mask = left_padded(2, 4, [0, 1])
    with pytest.raises(UnsupportedGenerationError, match=match), record_routes(qwen):
        qwen.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, **kwargs)
    assert hook_count(qwen) == 0


@pytest.mark.parametrize("how", ["positional config", "model's config under a wrapper", "added by a wrapper"])
def test_beam_search_is_refused_however_it_is_asked_for(qwen, how):
    """Found by review: beam search was recorded, with no error, from a positional config, from the model's own
    config under a wrapper module (whose generate has none), and when a wrapper's generate asked for it."""
    ids, mask = left_padded(2, 5, [0, 1])
    beams = GenerationConfig(num_beams=2, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    before = qwen.generation_config.num_beams
    try:
        with pytest.raises(UnsupportedGenerationError, match="beam search"), torch.no_grad():
            if how == "positional config":
                with record_routes(qwen):
                    qwen.generate(ids, beams, attention_mask=mask)
            elif how == "model's config under a wrapper":
                qwen.generation_config.num_beams = 2
                wrapper = Delegating(qwen)
                with record_routes(wrapper):
                    wrapper.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD)
            else:
                wrapper = Delegating(qwen, num_beams=2)
                with record_routes(wrapper):
                    wrapper.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD)
    finally:
        qwen.generation_config.num_beams = before


def test_generate_from_inputs_embeds_is_refused(qwen):
    ids, mask = left_padded(2, 4, [0, 1])
    embeds = qwen.get_input_embeddings()(ids)
    with pytest.raises(UnsupportedGenerationError, match="inputs_embeds"), record_routes(qwen):
        qwen.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD)


def test_continuous_batching_is_refused_at_the_call(qwen):
    """generate_batch packs several requests into one forward: refused when called, not recorded as B=1 batches."""
    from moe_replay import UnsupportedGenerationError

    with record_routes(qwen), pytest.raises(UnsupportedGenerationError, match="continuous batching"):
        qwen.generate_batch([[1, 2, 3]])
    assert "generate_batch" not in qwen.__dict__  # the refusal is scoped to the context


def test_model_without_router_is_an_error():
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    dense = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM registers no router outputs"):
        with record_routes(dense):
            pass
    assert hook_count(dense) == 0


def test_replay_rejects_non_routes(qwen):
    with pytest.raises(ValueError, match="needs a Routes, got Tensor"):
        replay_routes(qwen, torch.zeros(1, 1, 2, 2))
