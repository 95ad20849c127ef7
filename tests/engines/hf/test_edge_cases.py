"""Edge cases found in review: checkpointed backward outside the context, generate modes, early EOS, wrappers,
stale steps, reuse, overlapping contexts, scalar indices."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, hook_count, left_padded, perturb, recorded, sampled, tiny_qwen3_moe
from torch import nn

from moe_replay import ReplayError, Routes, UnsupportedGenerationError, keep_warm, record_routes, replay_routes


def test_checkpointed_backward_outside_the_context_is_refused(qwen):
    ids, mask = left_padded(2, 6, [0, 1])
    routes = recorded(qwen, ids, mask)
    qwen.train()
    qwen.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    before = hook_count(qwen)  # transformers adds an input hook for reentrant checkpointing
    with pytest.raises(ReplayError, match=r"call loss.backward\(\) inside"):
        with replay_routes(qwen, routes):
            loss = qwen(ids, attention_mask=mask, labels=ids).loss
    assert hook_count(qwen) == before
    with torch.no_grad(), replay_routes(qwen, routes):  # no backward coming: nothing waits, no error
        qwen(ids, attention_mask=mask)
    del loss


def test_accumulating_differently_shaped_forwards_under_checkpointing():
    model = tiny_qwen3_moe()
    a_ids, a_mask = left_padded(2, 6, [0, 1], seed=1)
    b_ids, b_mask = left_padded(3, 9, [2, 0, 0], seed=2)
    ra, rb = recorded(model, a_ids, a_mask), recorded(model, b_ids, b_mask)
    perturb(model)
    model.train()

    def grads(checkpointing):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad(set_to_none=True)
        with replay_routes(model, ra):
            la = model(a_ids, attention_mask=a_mask, labels=a_ids).loss
            with replay_routes(model, rb):  # the inner context replays rb; both backwards run inside their contexts
                lb = model(b_ids, attention_mask=b_mask, labels=b_ids).loss
                lb.backward()
            la.backward()
        model.gradient_checkpointing_disable()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = grads(False), grads(True)
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"use_cache": False}, "use_cache=True"),
        ({"num_beams": 2}, "beam search"),
        ({"guidance_scale": 1.5}, "classifier-free guidance"),
    ],
)
def test_generate_modes_that_cannot_be_followed(qwen, kwargs, match):
    ids, mask = left_padded(2, 4, [0, 1])
    with pytest.raises(UnsupportedGenerationError, match=match), record_routes(qwen):
        qwen.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD, **kwargs)
    embeds = qwen.get_input_embeddings()(ids)
    with pytest.raises(UnsupportedGenerationError, match="inputs_embeds"), record_routes(qwen):
        qwen.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD)


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


def test_inner_model_call_is_its_own_step(qwen):
    ids, mask = left_padded(2, 5, [0, 1])
    with record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
        qwen.model(ids, attention_mask=mask)
    assert len(rec.batches) == 2 and all("#" not in n for n in rec.routes.layer_names)


def test_contexts_are_reusable(qwen):
    ids, mask = left_padded(2, 5, [0, 1])
    rec = record_routes(qwen)
    with rec:
        qwen(ids, attention_mask=mask)
    first = rec.routes
    with rec:
        qwen(ids[:1], attention_mask=mask[:1])
    assert rec.routes.batch_size == 1 and first.batch_size == 2
    rep = replay_routes(qwen, first)
    with rep:
        qwen(ids, attention_mask=mask)
    with pytest.raises(ReplayError, match="never run"), rep:
        pass


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


def test_another_thread_running_the_model_or_opening_a_context_while_one_is_open_is_refused(qwen):
    """Another thread's forward during a recorded forward would be placed in it (its router calls as repeated
    layers): it is refused in that thread, and the recording is the recorded thread's alone. So is a context opened
    from another thread. A worker thread may run the model while no other forward runs (generate in a thread, as for
    a streamer), and with no context open any thread may."""
    import threading

    from moe_replay.errors import ForeignThreadError

    ids, mask = left_padded(2, 6, [0, 2])
    with torch.no_grad(), record_routes(qwen) as alone:
        qwen(ids, attention_mask=mask)
    raised = []

    def other(fn) -> None:  # noqa: ANN001
        try:
            fn()
        except ForeignThreadError as e:
            raised.append(e)

    def run_other(fn) -> None:  # noqa: ANN001
        thread = threading.Thread(target=other, args=(fn,))
        thread.start()
        thread.join()

    with torch.no_grad():
        layer = qwen.model.layers[1].register_forward_pre_hook(
            lambda m, a: run_other(lambda: qwen(ids + 1)) if not raised else None
        )
        with record_routes(qwen) as rec:
            qwen(ids, attention_mask=mask)
            run_other(lambda: record_routes(qwen).__enter__())
        layer.remove()
        assert len(raised) == 2 and rec.routes.equal(alone.routes)
        with record_routes(qwen) as worker:
            run_other(lambda: qwen(ids, attention_mask=mask))
        run_other(lambda: qwen(ids))  # no context open: any thread
    assert len(raised) == 2 and worker.routes.equal(alone.routes)


def test_overlapping_contexts_on_model_and_inner_model_are_refused(qwen):
    with record_routes(qwen):
        with pytest.raises(ReplayError, match="already hooked by a context opened on Qwen3MoeForCausalLM"):
            with record_routes(qwen.model):
                pass
    assert hook_count(qwen) == 0
    with record_routes(qwen.model):  # both hubs are now kept, with patches they would set again as they were
        pass
    for outer, inner, name in ((qwen, qwen.model, "Qwen3MoeForCausalLM"), (qwen.model, qwen, "Qwen3MoeModel")):
        with record_routes(outer):
            with pytest.raises(ReplayError, match=f"already hooked by a context opened on {name}"):
                with record_routes(inner):
                    pass
        assert hook_count(qwen) == 0


def test_scalar_tensor_index_keeps_batch_dim(qwen):
    ids, mask = left_padded(3, 5, [0, 1, 0])
    routes = recorded(qwen, ids, mask)
    import numpy as np

    for i in (torch.tensor(1), np.int64(1), 1):
        assert routes[i].shape == (1, 5, 2, 2) and torch.equal(routes[i].indices, routes.indices[1:2])


def test_interception_narrows_to_the_router_unless_top_k_runs_in_the_block(qwen):
    """After the first call, top-k interception runs in the router alone (the experts' ops skip the Python-level
    TorchFunctionMode), except for DBRX, whose top-k runs in the MoE block."""
    from families import build_tiny_model

    ids, mask = left_padded(2, 5, [0, 1])
    for model, expected in ((qwen, True), (build_tiny_model("dbrx"), False)):
        with keep_warm(model) as scope:
            with record_routes(model) as rec:
                model(ids, attention_mask=mask)
                model(ids, attention_mask=mask)  # the narrowed (or not) second call records the same routes
            facts = scope.facts  # learned per model, per router class
            assert [f.topk_in_router for f in facts.values()] == [expected]
        first, second = rec.batches
        assert first.equal(second)


def test_what_contexts_learn_is_kept_only_inside_keep_warm(qwen):
    """What a context learns about a router class is kept for the next context only inside a `keep_warm` scope on
    that model (not in module globals, not on the model once the scope closes)."""
    ids, mask = left_padded(2, 5, [0, 1])
    before = set(qwen.__dict__)
    first = recorded(qwen, ids, mask)
    assert set(qwen.__dict__) == before  # no scope: nothing kept
    with keep_warm(qwen) as scope:
        assert scope.facts == {}
        assert recorded(qwen, ids, mask).equal(first)
        (facts,) = scope.facts.values()
        assert facts.topk_in_router is True and facts.output_index == {False: 2}  # eval: output 2 is the indices
        assert recorded(qwen, ids, mask).equal(first)  # the next context starts from the facts (reads output 2)
        other = tiny_qwen3_moe()
        with keep_warm(other) as theirs:
            assert theirs.facts == {}  # another model of the same classes learns its own
            assert recorded(other, ids, mask).equal(first)
    assert set(qwen.__dict__) == before


def test_a_reused_mask_buffer_does_not_change_what_was_recorded(qwen):
    """The padding mask of a recorded forward is the one it ran with, even if the caller's buffer (long or bool)
    changes afterwards: routes are built after the context closes."""
    ids = torch.randint(PAD + 1, qwen.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.long, torch.bool):
        buffer = torch.ones(2, 6, dtype=dtype)
        buffer[0, :2] = 0  # left padding of row 0
        with torch.no_grad(), record_routes(qwen) as rec:
            qwen(ids, attention_mask=buffer)
            buffer.fill_(1)
            qwen(ids, attention_mask=buffer)
            buffer[1, :3] = 0
        first, second = rec.batches
        assert first.mask.tolist() == [[False, False, True, True, True, True], [True] * 6]
        assert second.mask.all()


def test_decode_step_masks_are_read_at_the_end_of_a_generate_as_they_were(qwen):
    """Inside `generate` the padding of decode steps is read once, from the latest mask: a hand-written decode loop
    run as the model's `generate` (a step without a mask, a step whose mask covers the new position alone, a padded
    decode position) records what the same loop records step by step, in each of two recorders, also after the
    caller refills its prompt mask buffer."""
    from transformers import DynamicCache

    def loop(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        cache, seq, full = DynamicCache(config=qwen.config), input_ids, attention_mask
        logits = qwen(input_ids, attention_mask=full, cache=cache, use_cache=True).logits
        for k in range(6):
            token = logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, token], 1)
            if k == 5:  # as in `generate`, the last sampled token is not forwarded
                break
            column = torch.ones(2, 1, dtype=full.dtype)
            if k == 3:
                column[1] = 0  # a padded decode position of row 1
            full = torch.cat([full, column], 1)  # as in `generate`: a new mask per step, the old one extended
            given = None if k == 0 else full[:, -1:] if k == 1 else full
            logits = qwen(token, attention_mask=given, cache=cache, use_cache=True).logits
        return seq

    got = []
    for as_generate in (False, True):
        ids, mask = left_padded(2, 5, [2, 0], seed=3)
        if as_generate:
            qwen.generate = loop  # the hub wraps it as the model's generate
        try:
            with torch.no_grad(), record_routes(qwen) as rec, record_routes(qwen) as inner:  # two recorders
                seq = qwen.generate(ids, mask) if as_generate else loop(ids, mask)
        finally:
            qwen.__dict__.pop("generate", None)
        mask.fill_(1)  # the caller reuses its buffer before reading the routes
        assert inner.routes.equal(rec.routes)
        got.append((seq, rec.routes))
    (seq, a), (same, b) = got
    assert same.equal(seq) and b.shape[1] == seq.shape[1] == a.shape[1] + 1 and b.indices[:, :-1].equal(a.indices)
    assert b.mask[:, :-1].equal(a.mask) and not b.mask[:, -1].any()  # the last sampled token is never forwarded
    assert b.mask[1, 8].item() is False and b.mask[0, 8].item() is True  # the padded decode position
    assert b.mask[0, :2].tolist() == [False, False] and b.mask[0, 2:-1].all()


def test_routes_recorded_and_replayed_in_inference_mode(qwen):
    """Tensors made in `torch.inference_mode()` count no in-place edits: routes recorded there replay there and
    outside it, and a replay there converts each forward's routes afresh, so that an edit between two forwards of
    one context is replayed (a conversion reused by version would replay the old experts)."""
    ids, mask = left_padded(2, 7, [0, 2])
    with torch.inference_mode(), record_routes(qwen) as rec:
        out = qwen.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=4, pad_token_id=PAD)
        routes = rec.routes
    assert routes.indices.is_inference()
    seq = out.clone()
    full = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
    with torch.no_grad(), replay_routes(qwen, routes):
        expected = qwen(seq, attention_mask=full).logits
    with torch.inference_mode(), replay_routes(qwen, routes):
        assert torch.equal(qwen(seq, attention_mask=full).logits, expected)
    edits = []
    for mode in (torch.inference_mode, torch.no_grad):  # converted there (no version) or outside (the routes' none)
        with mode(), replay_routes(qwen, routes):
            qwen(seq, attention_mask=full)
            with torch.inference_mode():  # (where alone an inference tensor can be edited)
                routes.indices[:, :, 0] = routes.indices[:, :, 0].flip(-1)  # the same experts, in swapped slots
                routes.indices[:, :, 1] = (routes.indices[:, :, 1] + 1) % qwen.config.num_experts  # other experts
            edits.append(qwen(seq, attention_mask=full).logits)
        with torch.no_grad(), replay_routes(qwen, Routes(routes.indices.clone(), routes.mask.clone(), routes.layers)):
            assert torch.equal(edits[-1], qwen(seq, attention_mask=full).logits)
    assert not torch.equal(edits[0], expected) and not torch.equal(edits[1], edits[0])
