"""`generate` as users call it: a generation config passed positionally, and a wrapper module's `generate` that calls
its model's (the settings and output of the innermost call are the ones that ran)."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, left_padded
from torch import nn
from transformers import GenerationConfig

from moe_replay import UnsupportedGenerationError, record_routes


class Delegating(nn.Module):
    """A wrapper module whose generate calls its model's with `extra` keyword arguments added."""

    def __init__(self, model: nn.Module, **extra) -> None:  # noqa: ANN003
        super().__init__()
        self.pretrained_model, self.extra = model, extra

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.pretrained_model(*args, **kwargs)

    def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.pretrained_model.generate(*args, **kwargs, **self.extra)


def sampled_mask(target: nn.Module, call) -> torch.Tensor:  # noqa: ANN001
    torch.manual_seed(0)
    with torch.no_grad(), record_routes(target) as rec:
        call(target)
    return rec.routes.mask


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
