"""Multi-turn and partial rollouts: `assemble_routes` builds one conversation's routes from each turn's `generate`
recording by the segment rule, keeps each position's policy version through files and packing, refuses conflicts,
and `fresh` bounds the routes' age. The property that matters: replaying the assembled routes gives the sampler's
log-probs at every model token."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, kv, near_ties, same_but_near_ties, tiny_qwen3_moe

from moe_replay import Routes, record_routes, replay_routes
from moe_replay.routes import Segment, assemble_routes, fresh, from_packed, to_packed


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :], mask[i, T - len(r) :] = r, 1
    return ids, mask


def _turn(model, rows: list[torch.Tensor], new: int, version: int, seed: int):
    """One `generate` turn over the conversations so far (no cache kept: the whole conversation is re-run)."""
    ids, mask = _left_pad(rows)
    torch.manual_seed(seed)
    with record_routes(model) as rec:
        kw = dict(do_sample=True, max_new_tokens=new, min_new_tokens=new, output_logits=True, pad_token_id=PAD)
        out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    sampled = out.sequences[:, ids.shape[1] :]
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, sampled[..., None]).squeeze(-1)
    full_mask = torch.cat([mask, torch.ones_like(sampled)], 1)
    lengths = torch.tensor([len(r) for r in rows])
    segment = Segment(rec.routes, full_mask, version=version, sampled_from=lengths - 1)
    return [torch.cat([r, s]) for r, s in zip(rows, sampled, strict=True)], segment, logp


def _conversation(model, versions=(0, 0), update=None):
    prompts = [torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 3)]
    rows, seg1, logp1 = _turn(model, prompts, 4, versions[0], seed=1)
    turn1 = [len(r) for r in rows]
    if update is not None:
        update(model)
    env = [torch.tensor([7, 8, 9]), torch.tensor([11])]  # tool output: positions whose next token was not sampled
    rows = [torch.cat([r, e]) for r, e in zip(rows, env, strict=True)]
    rows, seg2, logp2 = _turn(model, rows, 3, versions[1], seed=2)
    return rows, (seg1, seg2), (logp1, logp2), turn1


def _answer_logp(model, ids, mask, routes=None):
    import contextlib

    with torch.no_grad(), replay_routes(model, routes) if routes is not None else contextlib.nullcontext():
        logits = model(ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T - 1]


def test_a_two_turn_agent_loop_replays_to_the_sampler_log_probs():
    model = tiny_qwen3_moe(0).eval()
    rows, segments, (logp1, logp2), turn1 = _conversation(model)
    ids, mask = _left_pad(rows)
    routes = assemble_routes(segments, mask)
    assert routes.version is not None and routes.mask.sum() == mask.sum() - len(rows)  # all but each last token
    with record_routes(model) as live:
        logits = model(ids, attention_mask=mask, output_router_logits=True).router_logits
    # at the sampling weights, every position's assembled route is the one a teacher-forced forward takes (but at
    # that forward's near-ties, which float noise between generate and a full forward may swap: helpers.near_ties)
    assert (live.routes.mask | ~routes.mask).all()
    same_but_near_ties(routes, live.routes, near_ties(logits, routes.top_k, tuple(ids.shape)))
    replayed = _answer_logp(model, ids, mask, routes)
    for i, row in enumerate(rows):
        pad = ids.shape[1] - len(row)
        first = pad + turn1[i] - 4  # turn 1's 4 sampled tokens, then 3 tool tokens, turn 2's 3
        torch.testing.assert_close(replayed[i, first - 1 : first + 3], logp1[i], rtol=0, atol=1e-5)
        torch.testing.assert_close(replayed[i, -3:], logp2[i], rtol=0, atol=1e-5)


def test_a_conversation_over_one_kept_cache_is_one_batch_whose_replay_gives_the_sampler_log_probs():
    """Turn 1, tool tokens, turn 2, each `generate` continuing the KV cache the turn before left, inside one context:
    one batch spanning turn 2's out.sequences, every position routed once (by the forward that put it in the cache),
    turn 1's positions as turn 1 alone recorded them; replaying it gives the sampler's log-probs at every sampled
    token (fp32), and a turn that raises drops the conversation (its cache holds that turn's steps too)."""
    from transformers import DynamicCache

    model = tiny_qwen3_moe(0).eval()
    ids, mask = _left_pad([torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 3)])
    kw = dict(do_sample=True, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD)
    cache, logps, env = DynamicCache(), [], torch.tensor([[7, 8, 9], [11, 12, 13]])

    def turn(ids, mask, new, seed):  # noqa: ANN001, ANN202
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, **kv(cache), max_new_tokens=new,
                             min_new_tokens=new, **kw)  # fmt: skip
        sampled = out.sequences[:, ids.shape[1] :]
        logps.append(torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, sampled[..., None])[..., 0])
        return out.sequences, torch.cat([mask, torch.ones_like(sampled)], 1)

    with torch.no_grad(), record_routes(model) as rec:
        seq1, mask1 = turn(ids, mask, 4, seed=1)
        turn1 = rec.routes
        seq2, mask2 = turn(torch.cat([seq1, env], 1), torch.cat([mask1, torch.ones_like(env)], 1), 3, seed=2)
    (routes,) = rec.batches
    assert routes.shape[:2] == seq2.shape and torch.equal(routes.mask[:, :-1], mask2[:, :-1].bool())
    assert not routes.mask[:, -1].any()  # (the last sampled token is never fed)
    T1 = seq1.shape[1] - 1
    assert turn1.equal(Routes(routes.indices[:, : T1 + 1], turn1.mask, routes.layers))
    replayed = _answer_logp(model, seq2, mask2, routes)
    torch.testing.assert_close(replayed[:, T1 - 4 : T1], logps[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(replayed[:, -3:], logps[1], rtol=0, atol=1e-5)

    class Stop(RuntimeError):
        pass

    def stop_at_step_2(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise Stop

    cache = DynamicCache()
    with torch.no_grad(), record_routes(model) as rec:
        seq1, mask1 = turn(ids, mask, 4, seed=1)
        with pytest.raises(Stop):
            model.generate(input_ids=torch.cat([seq1, env], 1), attention_mask=torch.cat([mask1, mask1[:, :3]], 1),
                           **kv(cache), max_new_tokens=3, stopping_criteria=[stop_at_step_2], **kw)  # fmt: skip
    assert rec.batches == []


def test_a_rollout_resumed_after_an_update_keeps_segment_one_routes_and_version():
    model = tiny_qwen3_moe(0).eval()

    def step(m):  # an optimizer step's worth of change to the routers between the two segments
        with torch.no_grad():
            for layer in m.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "weight"):
                    gate.weight.add_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(3)))

    rows, (seg1, seg2), _, turn1 = _conversation(model, versions=(4, 5), update=step)
    ids, mask = _left_pad(rows)
    routes = assemble_routes([seg1, seg2], mask)
    for i, row in enumerate(rows):
        pad = ids.shape[1] - len(row)
        segment1 = torch.arange(pad, pad + turn1[i] - 1)  # the prompt and turn 1's sampled tokens but the last
        assert (routes.version[i, segment1] == 4).all()
        src = seg1.attention_mask[i].bool().nonzero().squeeze(1)[segment1 - pad]
        assert torch.equal(routes.indices[i, segment1].sort(-1).values, seg1.routes.indices[i, src].sort(-1).values)
        later = torch.arange(pad + turn1[i] - 1, ids.shape[1] - 1)  # tool tokens and turn 2: the new weights
        assert (routes.version[i, later] == 5).all()
    young = fresh(routes, current=5, max_age=0)
    assert torch.equal(young.mask, routes.mask & (routes.version == 5))
    assert torch.equal(fresh(routes, current=6, max_age=2).mask, routes.mask)
    with replay_routes(model, young):  # the stale positions route live
        model(ids, attention_mask=mask)


def test_conflicts_versions_and_bad_segments_are_refused():
    model = tiny_qwen3_moe(0).eval()
    rows, (seg1, seg2), _, turn1 = _conversation(model)
    ids, mask = _left_pad(rows)
    first = _left_pad([r[:t] for r, t in zip(rows, turn1, strict=True)])[1]  # the conversations after turn 1
    # two segments that both sampled from the same positions: identical routes are settled, different ones raise
    assert assemble_routes([seg1, seg1], first).mask.any()
    other = seg1.routes.indices.clone()
    other[..., 0], other[..., 1] = seg1.routes.indices[..., 1], seg1.routes.indices[..., 0]  # same sets: settled
    swapped = Segment(Routes(other, seg1.routes.mask, seg1.routes.layers), seg1.attention_mask, 0, seg1.sampled_from)
    assemble_routes([seg1, swapped], first)
    changed = seg1.routes.indices.clone()
    changed[..., 0] = (changed[..., 1].long() + 1 + changed[..., 0].long()) % 8
    changed[..., 0] = torch.where(changed[..., 0] == changed[..., 1], (changed[..., 0] + 1) % 8, changed[..., 0])
    clash = Segment(Routes(changed, seg1.routes.mask, seg1.routes.layers), seg1.attention_mask, 0, seg1.sampled_from)
    with pytest.raises(ValueError, match=r"segments 0 and 1 both sampled from it, with different routes"):
        assemble_routes([seg1, clash], first)
    late = Segment(seg1.routes, seg1.attention_mask, version=3, sampled_from=seg1.sampled_from)
    with pytest.raises(ValueError, match="segment 1 has version 0 after segment 0's 3: versions cannot go backwards"):
        assemble_routes([late, seg2], mask)
    with pytest.raises(ValueError, match="segment 0, conversation 0: it reaches position .* holds 2 tokens"):
        assemble_routes([seg1], torch.tensor([[1, 1], [1, 1]]))
    with pytest.raises(
        ValueError, match=r"segment 0: sampled_from must be one whole number >= 0 or one per conversation"
    ):
        assemble_routes([Segment(seg1.routes, seg1.attention_mask, 0, [1, 2, 3])], mask)
    with pytest.raises(ValueError, match="has version 5, newer than current=4"):
        fresh(Routes(seg1.routes.indices, seg1.routes.mask, seg1.routes.layers,
                     torch.full(seg1.routes.mask.shape, 5)), current=4, max_age=1)  # fmt: skip
    with pytest.raises(ValueError, match="fresh needs routes with versions"):
        fresh(seg1.routes, current=0, max_age=1)
    for bad in (-1, 1.5, True):
        with pytest.raises(
            ValueError, match=r"segment 0: version must be a whole number from 0 to 2147483647 \(a policy version\)"
        ):
            assemble_routes([Segment(seg1.routes, seg1.attention_mask, bad, seg1.sampled_from)], first)
    versioned = assemble_routes([seg1], first)
    for current, max_age, name in ((2.0, 1, "current"), (-1, 1, "current"), (2, None, "max_age"), (2, -1, "max_age")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 0, got"):
            fresh(versioned, current=current, max_age=max_age)


def test_segments_that_contradict_themselves_are_refused_not_misread():
    """Each was read silently (found by review): a left-padded turn given a right-padded mask (its routes landed `pad`
    positions off, those the mask calls padding dropped), a mask of 0.5s (read as all real), float offsets (truncated);
    a version past int32 raised torch's overflow, and a numpy integer version was refused."""
    import numpy as np

    model = tiny_qwen3_moe(0).eval()
    rows, (seg1, seg2), _, turn1 = _conversation(model)
    first = _left_pad([r[:t] for r, t in zip(rows, turn1, strict=True)])[1]
    right = seg1.attention_mask.flip(1)  # the same lengths, padded on the other side
    with pytest.raises(ValueError, match="segment 0, conversation 1: a route is recorded at position 7 of the "
                       "segment's batch, which its attention_mask marks padding"):  # fmt: skip
        assemble_routes([Segment(seg1.routes, right, 0, seg1.sampled_from)], first)
    half = seg1.attention_mask * 0.5
    with pytest.raises(ValueError, match="0/1 integers or bools, got torch.float32"):
        assemble_routes([Segment(seg1.routes, half, 0, seg1.sampled_from)], first)
    with pytest.raises(ValueError, match="0/1 integers or bools, got torch.float32"):
        assemble_routes([seg1], first.float())
    for name, bad in (("sampled_from", seg1.sampled_from.float() + 0.5), ("sampled_from", 3.0), ("start", 0.5)):
        kw = {"sampled_from": seg1.sampled_from, name: bad}
        with pytest.raises(ValueError, match=f"segment 0: {name} must be one whole number >= 0"):
            assemble_routes([Segment(seg1.routes, seg1.attention_mask, 0, **kw)], first)
    with pytest.raises(ValueError, match="version must be a whole number from 0 to 2147483647"):
        assemble_routes([Segment(seg1.routes, seg1.attention_mask, 2**31, seg1.sampled_from)], first)
    top = assemble_routes([Segment(seg1.routes, seg1.attention_mask, 2**31 - 1, seg1.sampled_from)], first)
    assert int(top.version[top.mask].min()) == 2**31 - 1
    numpy_version = assemble_routes([Segment(seg1.routes, seg1.attention_mask, np.int64(3), seg1.sampled_from)], first)
    assert numpy_version.equal(
        assemble_routes([Segment(seg1.routes, seg1.attention_mask, 3, seg1.sampled_from)], first)
    )
    # fresh compares in int64: a current past 2**31 ages every route (int32 wrapped it and kept them all as fresh)
    assert not fresh(top, current=2**32, max_age=5).mask.any()
    assert torch.equal(fresh(top, current=2**31 + 3, max_age=5).mask, top.mask)
    assert torch.equal(fresh(numpy_version, current=np.int64(4), max_age=np.int64(1)).mask, numpy_version.mask)


def test_nothing_recorded_is_lost_through_files_packing_and_selection(tmp_path):
    model = tiny_qwen3_moe(0).eval()
    rows, segments, _, _ = _conversation(model, versions=(2, 3))
    ids, mask = _left_pad(rows)
    routes = assemble_routes(segments, mask)
    routes.save(tmp_path / "r.safetensors")
    loaded = Routes.load(tmp_path / "r.safetensors")
    assert loaded.equal(routes) and torch.equal(loaded.version, routes.version)
    assert Routes.load(tmp_path / "r.safetensors", validate=False).equal(routes)
    packed = to_packed(routes, mask, multiple=4)
    assert packed.routes.version is not None
    back = from_packed(packed.routes, packed.cu_seqlens, mask, cu_seqlens_padded=packed.cu_seqlens_padded)
    assert back.equal(routes)
    aged = fresh(packed.routes, current=3, max_age=0)  # packed routes keep their place through the age bound
    assert type(aged) is type(packed.routes) and aged.place().keys() == packed.routes.place().keys()
    assert aged.place() == packed.routes.place() and 0 < aged.mask.sum() < packed.routes.mask.sum()
    assert routes[[1]].equal(Routes.cat([routes[[0]], routes[[1]]])[[1]])
    assert routes.pad_to(routes.seq_len + 2)[[0]].version.shape == (1, routes.seq_len + 2)
    with pytest.raises(ValueError, match="cannot concatenate Routes with and without versions"):
        Routes.cat([routes, segments[0].routes])
    assert not routes.equal(Routes(routes.indices, routes.mask, routes.layers))  # (a version is part of equality)
    with pytest.raises(ValueError, match="version must be an integer tensor"):
        Routes(routes.indices, routes.mask, routes.layers, routes.version.float())
    with pytest.raises(ValueError, match=r"version is \(2, 3\) on cpu; the mask is"):
        Routes(routes.indices, routes.mask, routes.layers, torch.zeros(2, 3, dtype=torch.int32))


def test_a_format_1_file_still_loads_and_cannot_smuggle_versions(tmp_path):
    import json

    from safetensors.torch import save_file

    layers = [{"name": "g", "num_experts": 8, "top_k": 2}]
    tensors = {
        "indices": torch.tensor([[[[0, 1]], [[2, 3]]]], dtype=torch.uint8),
        "mask": torch.tensor([[True, False]]),
    }
    save_file(tensors, tmp_path / "v1.safetensors", {"format": "moe-replay.routes", "version": "1",
                                                      "layers": json.dumps(layers)})  # fmt: skip
    old = Routes.load(tmp_path / "v1.safetensors")
    assert old.version is None and old.mask.tolist() == [[True, False]]
    tensors["version"] = torch.zeros((1, 2), dtype=torch.int32)
    save_file(tensors, tmp_path / "bad.safetensors", {"format": "moe-replay.routes", "version": "1",
                                                       "layers": json.dumps(layers)})  # fmt: skip
    with pytest.raises(Exception, match="expected \\['indices', 'mask'\\] \\(and 'version' from format 2\\)"):
        Routes.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("layers", [1, 4])  # rows of 2 and 8 bytes (the word-copy path)
def test_assembly_matches_the_rule_written_out_per_position(layers):
    from moe_replay import LayerInfo

    g = torch.Generator().manual_seed(layers)
    B, T, E = 3, 12, 8
    info = [LayerInfo(f"l{i}", E, 2) for i in range(layers)]
    keep = torch.ones(B, T, dtype=torch.long)
    keep[1, :3] = 0  # a left-padded conversation
    lengths = keep.sum(1)
    segs = []
    turns = [(0, 4, 7), (0, 6, 10), (8, 9, 12)]  # (start, sampled_from, end): re-runs, then a kept-cache continuation
    for s, (start, sampled_from, end) in enumerate(turns):
        width = end - start
        own = (lengths - (T - end)).clamp(min=0) - start  # the row's tokens in [start, end) (row 1 is 3 shorter)
        real = (torch.arange(width)[None] >= width - own[:, None]).long()
        recorded = real.bool() & (torch.rand(B, width, generator=g) > 0.2)
        first = torch.randint(0, E, (B, width, layers, 1), generator=g)
        segs.append(Segment(Routes(torch.cat([first, (first + 1) % E], -1), recorded, info), real, s, sampled_from,
                            start))  # fmt: skip

    def computed(i, p):  # [(segment, its column)] of the segments that recorded conversation position p of row i
        found = []
        for s, seg in enumerate(segs):
            real_cols = seg.attention_mask[i].bool().nonzero().flatten()
            k = p - seg.start
            if 0 <= k < len(real_cols) and seg.routes.mask[i, real_cols[k]]:
                found.append((s, int(real_cols[k])))
        return found

    for i in range(B):  # later samplers agree with the first one (two that disagree are an error, tested above)
        for p in range(int(lengths[i])):
            samplers = [(s, c) for s, c in computed(i, p) if p >= segs[s].sampled_from]
            for s, c in samplers[1:]:
                segs[s].routes.indices[i, c] = segs[samplers[0][0]].routes.indices[i, samplers[0][1]]
    want = torch.zeros(B, T, layers, 2, dtype=torch.uint8)
    want_mask = torch.zeros(B, T, dtype=torch.bool)
    want_version = torch.zeros(B, T, dtype=torch.int32)
    for i in range(B):
        columns = keep[i].bool().nonzero().flatten()
        for p in range(int(lengths[i])):
            found = computed(i, p)
            samplers = [(s, c) for s, c in found if p >= segs[s].sampled_from]
            if found:  # the first forward that sampled from p, else the first that computed it
                s, c = samplers[0] if samplers else found[0]
                want[i, columns[p]], want_mask[i, columns[p]] = segs[s].routes.indices[i, c], True
                want_version[i, columns[p]] = s
    got = assemble_routes(segs, keep)
    assert torch.equal(got.mask, want_mask) and want_mask.sum() > 20
    assert torch.equal(got.version[want_mask], want_version[want_mask]) and set(want_version[want_mask].tolist()) == {
        0,
        1,
        2,
    }
    assert torch.equal(got.indices[want_mask], want[want_mask])
