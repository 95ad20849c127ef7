"""Forwards with a KV cache: each continues its own batch where that batch ended, or is refused (a cache reused by
the next generate, rolled back, copied at another length, or continued after another batch's cache began)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from helpers import PAD, kv, left_padded, perturb, sampled, tiny_qwen3_moe
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

from moe_replay import UnsupportedGenerationError, find_routers, record_routes, replay_routes


def test_a_cache_emptied_between_two_generates_starts_a_new_batch(qwen):
    """A generate's later steps continue its stream without asking their (same) cache its length; a cache passed
    again to the next generate is asked afresh: emptied there, that generate is a batch of its own. The hub lets go
    of the cache when the generate returns."""
    from transformers import DynamicCache

    ids, mask = left_padded(2, 5, [0, 1])
    cache, outs = DynamicCache(), []
    sampling = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": True, "pad_token_id": PAD}
    with torch.no_grad(), record_routes(qwen) as rec:
        for _ in range(2):
            torch.manual_seed(0)
            outs.append(qwen.generate(input_ids=ids, attention_mask=mask, **kv(cache), **sampling))
            cache.crop(-cache.get_seq_length())  # emptied
    first, second = rec.batches
    assert torch.equal(outs[0], outs[1]) and first.seq_len == outs[0].shape[1] and first.equal(second)
    held = weakref.ref(cache)
    del cache
    gc.collect()
    assert held() is None  # the model's kept hub holds no generate's cache once it returned


def test_a_generate_given_a_cache_that_holds_tokens_is_refused_at_its_first_step(qwen):
    """A generate given a cache that the context did not see filled (filled before it opened, or after which another
    batch began) would continue routes that out.sequences cannot place: refused as it starts, and what was recorded
    before is kept. (The cache the last generate inside the context left continues its conversation:
    tests/routes/test_segments.py.)"""
    from transformers import DynamicCache

    ids, _ = left_padded(1, 5, [0])
    sampling = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": True, "pad_token_id": PAD}
    torch.manual_seed(0)
    with torch.no_grad(), record_routes(qwen) as alone:
        qwen.generate(input_ids=ids, **sampling)
    cache = DynamicCache()
    with torch.no_grad(), record_routes(qwen) as rec:
        torch.manual_seed(0)
        out = qwen.generate(input_ids=ids, **kv(cache), **sampling)
        turn = torch.cat([out, ids[:, :2]], 1)
        qwen(ids)  # another batch began
        with pytest.raises(UnsupportedGenerationError, match="already holds 7 tokens, not the one .* fresh cache"):
            qwen.generate(input_ids=turn, **kv(cache), **sampling)
        assert qwen.generate(input_ids=turn, **sampling).shape[1] == turn.shape[1] + 3  # a fresh cache: recorded
    first, _, second = rec.batches
    assert first.equal(alone.routes) and second.seq_len == turn.shape[1] + 3
    with torch.no_grad(), record_routes(qwen):  # filled before the context opened
        with pytest.raises(UnsupportedGenerationError, match="already holds"):
            qwen.generate(input_ids=turn, **kv(cache), **sampling)


def test_a_conversation_over_a_kept_cache_replays_across_its_turns(qwen):
    """The routes of a two-turn conversation over one kept cache (one batch), replayed on a perturbed model over the
    same two turns (again one kept cache): every recorded position takes its recorded experts in either turn."""
    from transformers import DynamicCache

    ids, mask = left_padded(2, 5, [0, 2])
    env = torch.tensor([[7, 8, 9], [11, 12, 13]])
    kw = {"do_sample": True, "pad_token_id": PAD, "return_dict_in_generate": True}

    def conversation() -> None:
        cache = DynamicCache()
        torch.manual_seed(1)
        first = qwen.generate(input_ids=ids, attention_mask=mask, **kv(cache), max_new_tokens=4, min_new_tokens=4, **kw)
        ids2 = torch.cat([first.sequences, env], 1)
        torch.manual_seed(2)
        mask2 = torch.cat([mask, torch.ones(2, 7, dtype=mask.dtype)], 1)
        qwen.generate(input_ids=ids2, attention_mask=mask2, **kv(cache), max_new_tokens=3, min_new_tokens=3, **kw)

    with torch.no_grad(), record_routes(qwen) as rec:
        conversation()
    (routes,) = rec.batches
    assert routes.shape[:2] == (2, 15) and routes.mask.sum() == 2 * 14 - 2  # (row 1's two pads, each last token)
    perturb(qwen)
    with torch.no_grad(), replay_routes(qwen, routes), record_routes(qwen) as used:
        conversation()
    (got,) = used.batches
    assert torch.equal(got.mask, routes.mask) and torch.equal(got.indices[got.mask], routes.indices[routes.mask])


def test_a_turn_recorded_without_its_earlier_turns_is_refused_before_it_runs(qwen):
    """A record_routes opened for turn 2 only of a kept-cache conversation (nested in a context open since turn 1), or
    a turn continuing a cache a plain forward filled, cannot place its routes: refused at the turn's first forward,
    naming the cause (found by review: raised after the whole generation ran, the output lost, and for the nested
    case with the plain-forward message)."""
    from transformers import DynamicCache

    ids, mask = left_padded(2, 5, [0, 2])
    kw = {"do_sample": True, "pad_token_id": PAD, "return_dict_in_generate": True, "max_new_tokens": 3}
    calls = []
    handle = qwen.model.layers[0].mlp.gate.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad(), record_routes(qwen) as outer:
            cache = DynamicCache()
            first = qwen.generate(input_ids=ids, attention_mask=mask, **kv(cache), **kw)
            turn = torch.cat([first.sequences, ids[:, :2]], 1)
            mask2 = torch.cat([mask, torch.ones(2, turn.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
            calls.clear()
            with record_routes(qwen), pytest.raises(ValueError, match="earlier turns ran before this record_routes"):
                qwen.generate(input_ids=turn, attention_mask=mask2, **kv(cache), **kw)
            assert calls == []  # refused before any router ran
            assert qwen.generate(input_ids=turn, attention_mask=mask2, **kv(cache), **kw).sequences.shape[1] == 13
        (routes,) = outer.batches  # the outer context, open since turn 1, recorded both turns
        assert routes.seq_len == 13 and routes.mask[:, 8:].any()
        with torch.no_grad(), record_routes(qwen):
            cache = DynamicCache()
            qwen(ids, attention_mask=mask, **kv(cache), use_cache=True)  # a plain forward fills the cache
            calls.clear()
            following = torch.cat([ids, ids[:, :2]], 1)
            with pytest.raises(ValueError, match="the cache was filled by a plain forward, not a generate"):
                qwen.generate(input_ids=following, attention_mask=torch.ones_like(following), **kv(cache), **kw)
            assert calls == []
    finally:
        handle.remove()


def test_a_kept_cache_turn_must_continue_the_tokens_the_cache_holds_and_sees_their_padding_as_it_ran(qwen):
    """A turn over a kept cache whose input does not start with the last turn's out.sequences (rows reordered with
    the cache, or the history edited) would put routes on other tokens: refused. A turn run without an attention
    mask (inferred from the pad id) leaves the turn before's padding after an EOS unrecorded, as its forwards saw it.
    (Both found by review: the first gave wrong experts at 16 of 26 positions with no error.)"""
    from transformers import DynamicCache, LogitsProcessor

    class EndRowZero(LogitsProcessor):
        def __init__(self) -> None:
            self.n = 0

        def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
            if self.n == 1:  # row 0 samples EOS (id 5) at its second step: the rest of its row is padding
                scores[0] = -1e9
                scores[0, 5] = 0
            self.n += 1
            return scores

    ids, mask = left_padded(2, 5, [0, 2])
    kw = {"do_sample": True, "pad_token_id": PAD, "eos_token_id": 5, "suppress_tokens": [PAD]}
    env = torch.tensor([[7, 8]] * 2)
    for edit in ("reorder", "history"):
        cache = DynamicCache()
        with torch.no_grad(), record_routes(qwen) as rec:
            torch.manual_seed(1)
            first = qwen.generate(input_ids=ids, attention_mask=mask, **kv(cache), max_new_tokens=4, min_new_tokens=4,
                                  **kw)  # fmt: skip
            if edit == "reorder":
                cache.reorder_cache(torch.tensor([1, 0]))
                history = first[[1, 0]]
            else:
                history = first.clone()
                history[0, -1] = (history[0, -1] + 1) % 60 + 1
            turn = torch.cat([history, env], 1)
            with pytest.raises(ValueError, match="row 0 differs at position .* from the tokens the cache holds"):
                qwen.generate(input_ids=turn, attention_mask=torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], 1),
                              **kv(cache), max_new_tokens=2, min_new_tokens=2, **kw)  # fmt: skip
        with pytest.raises(ValueError, match="differs at position"):
            _ = rec.routes  # (the conversation's routes stay refused)
    cache = DynamicCache()
    with torch.no_grad(), record_routes(qwen) as rec:
        torch.manual_seed(1)
        first = qwen.generate(input_ids=ids, attention_mask=mask, **kv(cache), max_new_tokens=5,
                              logits_processor=[EndRowZero()], **kw)  # fmt: skip
        second = qwen.generate(input_ids=torch.cat([first, env], 1), **kv(cache), max_new_tokens=3, min_new_tokens=3,
                               **kw)  # fmt: skip
    (routes,) = rec.batches
    seen = second != PAD  # the mask generate inferred and its forwards ran with
    assert not seen[0, 7:10].any() and torch.equal(routes.mask[:, :-1], seen[:, :-1])
    with torch.no_grad(), replay_routes(qwen, routes):
        qwen(second, attention_mask=seen.long())


@pytest.mark.parametrize("how", ["copied", "cropped"])
def test_a_forward_continuing_a_cache_that_does_not_end_where_its_stream_does_is_refused(qwen, how):
    """Scoring two continuations, each from a copy of a prompt's cache (or after rolling the cache back), would place
    the second at the end of the first: refused, since its positions are the cache's, not the stream's."""
    import copy

    from transformers import DynamicCache

    ids, _ = left_padded(2, 6, [0, 0])
    first, second = ids[:, :3] + 1, ids[:, :3] + 2
    with torch.no_grad(), record_routes(qwen) as rec:
        cache = DynamicCache()
        qwen(ids, **kv(cache), use_cache=True)
        qwen(first, **kv(copy.deepcopy(cache) if how == "copied" else cache), use_cache=True)
        if how == "cropped":
            cache.crop(-3)  # (drops the last 3 tokens)
        with pytest.raises(ValueError, match="holds 6 tokens, but the stream it would continue ends at position 9"):
            qwen(second, **kv(copy.deepcopy(cache) if how == "copied" else cache), use_cache=True)
    assert rec.routes.seq_len == 9  # the prompt and the first continuation, as they ran


@pytest.mark.parametrize("given", ["passed", "returned"])
def test_a_cache_of_an_earlier_batch_continued_after_another_began_is_refused(qwen, given):
    """Two prompts scored with a cache each, then continued in turn: the first one's continuation would be placed at
    the end of the second batch, whose length it happens to match. Refused, whether the caches were passed in or
    made by the forwards (`out.past_key_values` fed back); the current batch's own cache still continues it."""
    from transformers import DynamicCache

    ids, _ = left_padded(2, 6, [0, 0])
    other, more = ids.flip(1), ids[:, :2] + 1
    with torch.no_grad(), record_routes(qwen) as rec:
        caches = []
        for prompt in (ids, other):
            if given == "passed":
                caches.append(DynamicCache())
                qwen(prompt, **kv(caches[-1]), use_cache=True)
            else:
                caches.append(qwen(prompt, use_cache=True).past_key_values)
        with pytest.raises(ValueError, match=r"KV cache \(6 tokens\) of an earlier batch .* 2 rows at position 6"):
            qwen(more, **kv(caches[0]), use_cache=True)
        qwen(more, **kv(caches[1]), use_cache=True)
    first, second = rec.batches
    assert first.seq_len == 6 and second.seq_len == 8


def test_a_generate_continued_after_the_next_generate_is_refused(qwen):
    """A chat's second turn fed the first generate's `out.past_key_values` after another generate ran."""
    ids, mask = left_padded(1, 5, [0])
    sampling = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": True, "pad_token_id": PAD}
    with torch.no_grad(), record_routes(qwen):
        outs = [qwen.generate(input_ids=x, return_dict_in_generate=True, **sampling) for x in (ids, ids.flip(1))]
        turn = outs[0].sequences[:, -1:]
        with pytest.raises(ValueError, match="of an earlier batch after another batch began"):
            qwen(turn, **kv(outs[0].past_key_values), use_cache=True)


def test_a_copy_of_the_running_batchs_cache_continues_it_and_no_cache_is_kept_alive(qwen):
    """Forking the running batch's cache (a deep copy at its length) continues the batch; the caches the hub noted
    are not kept alive by it."""
    from transformers import DynamicCache

    ids, _ = left_padded(2, 6, [0, 0])
    with torch.no_grad(), record_routes(qwen) as rec:
        cache = DynamicCache()
        qwen(ids, **kv(cache), use_cache=True)
        fork = copy.deepcopy(cache)
        qwen(ids[:, :2], **kv(fork), use_cache=True)
        held = [weakref.ref(cache), weakref.ref(fork)]
        del cache, fork
        gc.collect()
        assert all(ref() is None for ref in held)
    assert rec.routes.seq_len == 8


def test_caches_returned_in_a_tuple_or_made_by_generates_first_forward_are_noted(qwen):
    """The interleaving check knows a cache a forward returned in a tuple (`return_dict=False`), and one that
    generate's first forward made itself (MiniMax makes its cache in the model): both were missed (found by
    review)."""
    from families import build_tiny_model

    ids, _ = left_padded(2, 5, [0, 0])
    with torch.no_grad(), record_routes(qwen):
        _, cache = qwen(ids, use_cache=True, return_dict=False)
        qwen(ids.flip(1), use_cache=True)
        with pytest.raises(ValueError, match="of an earlier batch after another batch began"):
            qwen(ids[:, :1], **kv(cache), use_cache=True)
    minimax = build_tiny_model("minimax").eval()
    with torch.no_grad(), record_routes(minimax):
        out = minimax.generate(input_ids=ids, max_new_tokens=1, pad_token_id=PAD, return_dict_in_generate=True)
        minimax(ids.flip(1))
        with pytest.raises(ValueError, match="of an earlier batch after another batch began"):
            minimax(out.sequences[:, -1:], **kv(out.past_key_values), use_cache=True)


def test_a_mask_preallocated_for_a_static_cache_records_the_steps_own_columns(qwen):
    """A decode loop over a StaticCache with one [B, max_len] attention mask (1 up to the current token, 0 for the
    slots to come), as compiled loops keep their shapes fixed: each forward's padding is read from its own columns,
    not the mask's last ones, which are the slots to come (found by review: every position went unrecorded)."""
    from transformers import StaticCache

    ids, mask = left_padded(2, 5, [0, 2], seed=2)
    masks = []
    for preallocated in (False, True):
        cache, full = StaticCache(config=qwen.config, max_cache_len=16), torch.zeros(2, 16, dtype=mask.dtype)
        full[:, :5] = mask
        grown = mask
        with torch.no_grad(), record_routes(qwen) as rec:
            out = qwen(ids, attention_mask=full if preallocated else mask, **kv(cache), cache_position=torch.arange(5))
            for k in range(3):
                token = out.logits[:, -1:].argmax(-1)
                full[:, 5 + k] = 1
                grown = torch.cat([grown, torch.ones(2, 1, dtype=mask.dtype)], 1)
                given = full if preallocated else grown
                out = qwen(token, attention_mask=given, **kv(cache), cache_position=torch.tensor([5 + k]))
        masks.append(rec.routes.mask)
    assert torch.equal(masks[1], masks[0]) and masks[0].sum() == 14 and not masks[0][1, :2].any()


@pytest.mark.parametrize("cache", ALL_CACHE_IMPLEMENTATIONS)
def test_every_cache_implementation_records_what_each_router_selected_and_replays_it(cache):
    """Under `generate` with each of transformers' cache implementations (left padding, 4 new tokens): the routes hold,
    at each prompt and generated position, what forward hooks on the routers (no moe-replay) saw them select, with
    padding and the last sampled token unrecorded; a replay of them under the same cache, on a perturbed model, makes
    every router select them again."""
    if cache.startswith("offloaded") and not torch.cuda.is_available():
        pytest.skip("transformers' offloaded caches need CUDA")
    if cache == "quantized":
        pytest.importorskip("optimum.quanto")  # (the dev extra installs it)
    device = "cuda" if cache.startswith("offloaded") else "cpu"
    qwen = tiny_qwen3_moe().to(device)
    ids, mask = (t.to(device) for t in left_padded(3, 6, [2, 0, 1]))
    sites, seen = find_routers(qwen), {}
    handles = [
        s.router.register_forward_hook(lambda m, a, out, n=s.name: seen.setdefault(n, []).append(out[2].clone()))
        for s in sites
    ]
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            out, routes = sampled(qwen, ids, mask, 4, cache_implementation=cache)
    finally:
        for handle in handles:
            handle.remove()
    assert out.sequences.shape == (3, 10) and routes.indices.shape[:3] == (3, 10, len(sites))
    assert torch.equal(routes.mask[:, :6], mask.bool()) and routes.mask[:, 6:-1].all() and not routes.mask[:, -1].any()
    for layer, site in enumerate(sites):
        prefill, *steps = seen[site.name]  # [B * 6, K], then [B, K] per decode step
        hooked = torch.cat([prefill.view(3, 6, -1)] + [s.view(3, 1, -1) for s in steps], 1)
        assert hooked.shape[1] == 9  # (the last sampled token is never fed)
        got = routes.indices[:, :9, layer].to(hooked.dtype)
        assert torch.equal(got[routes.mask[:, :9]], hooked[routes.mask[:, :9]])
    perturb(qwen)
    torch.manual_seed(1)
    with torch.no_grad(), replay_routes(qwen, routes), record_routes(qwen) as used:
        sampled(qwen, ids, mask, 4, cache_implementation=cache)
    assert torch.equal(used.routes.indices[routes.mask], routes.indices[routes.mask])
