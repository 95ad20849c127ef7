"""Models inside other tools' wrappers: a PEFT-like module (forward and generate passed through), PEFT LoRA (both
directions), torch.compile, and a wrapper whose forward takes (*args, **kwargs)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PAD, hook_count, left_padded, perturb, recorded
from torch import nn

from moe_replay import record_routes, replay_routes


def forced(model, ids, mask, routes):
    """The experts `model` uses under replay of `routes` (a recording nested in the replay)."""
    with replay_routes(model, routes), record_routes(model) as used:
        out = model(ids, attention_mask=mask)
    return used.routes, out


def test_peft_lora_records_and_replays_in_both_directions(qwen):
    peft = pytest.importorskip("peft")
    ids, mask = left_padded(2, 6, [0, 2])
    lora = peft.get_peft_model(copy.deepcopy(qwen), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    routes_lora = recorded(lora, ids, mask)  # names `base_model.model.model.layers.0.mlp.gate`, ...
    routes_bare = recorded(qwen, ids, mask)
    assert torch.equal(routes_lora.indices, routes_bare.indices)  # LoRA starts as the identity
    perturb(qwen)
    used, _ = forced(qwen, ids, mask, routes_lora)  # PEFT routes on the bare model: matched by dotted suffix
    assert torch.equal(used.indices[used.mask], routes_lora.indices[used.mask])
    perturb(lora, seed=3)
    lora.train()
    with replay_routes(lora, routes_bare), record_routes(lora) as used:  # bare routes on the PEFT model, trained
        lora(ids, attention_mask=mask, labels=ids).loss.backward()
    assert torch.equal(used.routes.indices[used.routes.mask], routes_bare.indices[used.routes.mask])
    lora_grads = [p.grad for n, p in lora.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None for g in lora_grads)


def test_torch_compile_records_and_replays_exactly(qwen):
    """torch.compile (eager backend, which runs the captured graphs as they are): routes equal the uncompiled
    model's, and replay on the compiled model forces them bit-exactly."""
    torch._dynamo.reset()
    ids, mask = left_padded(2, 6, [0, 1])
    expected = recorded(qwen, ids, mask)
    compiled = torch.compile(qwen, backend="eager")
    routes = recorded(compiled, ids, mask)  # names `_orig_mod.model.layers...`: same layers as the bare model's
    assert torch.equal(routes.indices, expected.indices) and torch.equal(routes.mask, expected.mask)
    logits = qwen(ids, attention_mask=mask).logits
    used, out = forced(compiled, ids, mask, expected)
    assert torch.equal(out.logits, logits) and torch.equal(used.indices, expected.indices)
    torch._dynamo.reset()


def test_a_wrapper_taking_star_args_passes_its_keyword_arguments_through(qwen):
    """A wrapper whose forward takes (*args, **kwargs) is bound by inspect: the attention mask in its **kwargs still
    places the padding."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return self.inner(*args, **kwargs)

    ids, mask = left_padded(2, 6, [0, 2])
    wrapper = Wrapper(qwen)
    with torch.no_grad(), record_routes(wrapper) as rec:
        wrapper(ids, attention_mask=mask)
    assert torch.equal(rec.routes.mask, mask.bool())
    assert torch.equal(rec.routes.indices[mask.bool()], recorded(qwen, ids, mask).indices[mask.bool()])


class Wrapper(nn.Module):
    """A PEFT-like wrapper: forward(*args, **kwargs) and generate passed through."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.inner.generate(*args, **kwargs)


def test_wrapped_model_records_and_replays_on_the_inner_model(qwen):
    wrapped = Wrapper(qwen)
    ids, mask = left_padded(2, 5, [0, 2])
    with record_routes(wrapped) as rec:
        ref = wrapped(input_ids=ids, attention_mask=mask).logits
        wrapped(ids, mask)  # positional call: a second batch
        out = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, pad_token_id=PAD)
    first, _, gen = rec.batches
    assert first.layer_names[0] == "inner.model.layers.0.mlp.gate" and gen.seq_len == out.shape[1]
    with replay_routes(qwen, first):  # names matched by their dotted suffix
        assert torch.equal(qwen(ids, attention_mask=mask).logits, ref)
    assert hook_count(wrapped) == 0
