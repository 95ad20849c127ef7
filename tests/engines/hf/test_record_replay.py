"""Record and replay on a tiny Qwen3-MoE: alignment under generate, exactness, gradients, checkpointing, slices."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import (
    PAD,
    extend_mask,
    left_padded,
    near_ties,
    perturb,
    recorded,
    same_but_near_ties,
    sampled,
    tiny_qwen3_moe,
)

from moe_replay import LayerInfo, ReplayError, Routes, record_routes, replay_routes
from moe_replay.engines.hf import hooks as hooks_module
from moe_replay.engines.hf.declared import own_methods


def generate(model, ids, mask, n=6, **kw):
    out, routes = sampled(model, ids, mask, n, **kw)
    return out.sequences, routes


def experts_used(model, fn):
    """The expert indices each MoE experts module actually received, via pre-hooks on the experts modules."""
    seen, handles = [], []
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            handles.append(m.register_forward_pre_hook(lambda mod, args: seen.append(args[1].clone())))
    try:
        out = fn()
    finally:
        for h in handles:
            h.remove()
    return seen, out


def agrees_with_teacher_forcing(routes, model, seq, mask):
    """Asserts that `routes` (recorded under generate) hold a teacher-forced forward's expert sets at every recorded
    (token, layer) pair but that forward's near-ties (float noise between the KV-cached decode and the full forward
    may swap those, and then what follows them: `helpers.same_but_near_ties`), and that some pair is compared."""
    with record_routes(model) as rec:
        logits = model(seq, attention_mask=mask, output_router_logits=True).router_logits
    tf = rec.routes
    assert torch.equal(routes.mask & tf.mask, routes.mask)
    same_but_near_ties(routes, tf, near_ties(logits, routes.top_k, seq.shape))


def test_generate_routes_align_with_teacher_forcing(qwen):
    torch.manual_seed(1)
    ids, mask = left_padded(3, 7, [3, 0, 1])
    seq, routes = generate(qwen, ids, mask, num_return_sequences=2)
    B, T = seq.shape
    assert routes.shape == (B, T, 2, 2) and B == 6
    full = extend_mask(mask.repeat_interleave(2, 0), T)
    # recorded: every fed real token; not padding, not the last sampled token
    expected = full.bool().clone()
    expected[:, -1] = False
    assert torch.equal(routes.mask, expected)
    agrees_with_teacher_forcing(routes, qwen, seq, full)


def test_replay_own_routes_is_bit_exact(qwen):
    ids, mask = left_padded(4, 9, [0, 2, 5, 1])
    with record_routes(qwen) as rec:
        ref = qwen(ids, attention_mask=mask).logits
    with replay_routes(qwen, rec.routes):
        out = qwen(ids, attention_mask=mask).logits
    assert torch.equal(ref, out)


def test_replay_forces_recorded_experts_after_an_update(qwen):
    ids, mask = left_padded(4, 10, [0, 0, 3, 0])
    with record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
    routes = rec.routes
    perturb(qwen)
    live, live_logits = experts_used(qwen, lambda: qwen(ids, attention_mask=mask).logits)
    with replay_routes(qwen, routes):
        forced, forced_logits = experts_used(qwen, lambda: qwen(ids, attention_mask=mask).logits)
    m = routes.mask.reshape(-1)
    assert len(forced) == len(live) == 2
    for layer, f in enumerate(forced):
        want = routes.indices[:, :, layer].reshape(-1, 2).long()
        assert torch.equal(f[m], want[m])  # replayed: exactly the recorded experts at recorded positions
    changed = sum(
        int((v[m].sort(-1).values != f[m].sort(-1).values).any(-1).sum()) for f, v in zip(forced, live, strict=True)
    )
    assert changed > 0  # without replay some tokens' experts moved
    assert not torch.equal(live_logits, forced_logits)


def test_router_gets_gradients_under_replay(qwen):
    ids, mask = left_padded(2, 8, [0, 2])
    with record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
    perturb(qwen)
    qwen.train()
    with replay_routes(qwen, rec.routes):
        qwen(ids, attention_mask=mask, labels=ids).loss.backward()
    grads = [p.grad for n, p in qwen.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in grads)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_replays_same_routes_and_records_once():
    ids, mask = left_padded(3, 8, [0, 1, 4])
    model = tiny_qwen3_moe()
    with record_routes(model) as rec:
        model(ids, attention_mask=mask)
    routes = rec.routes
    perturb(model)
    model.train()
    with replay_routes(model, routes):
        model(ids, attention_mask=mask, labels=ids).loss.backward()
    plain = _grads(model)
    model.zero_grad(set_to_none=True)
    for reentrant in (False, True):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        with replay_routes(model, routes), record_routes(model) as inner:
            model(ids, attention_mask=mask, labels=ids).loss.backward()
        ckpt = _grads(model)
        model.zero_grad(set_to_none=True)
        assert plain.keys() == ckpt.keys()
        for n in plain:
            torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7, msg=n)
        # the recorder saw one forward (no duplicates from the recompute), and it used the replayed experts
        assert len(inner.batches) == 1 and inner.routes.equal(routes)
        model.gradient_checkpointing_disable()


def test_minibatch_slices_replay_exactly(qwen):
    ids, mask = left_padded(6, 9, [0, 3, 0, 1, 5, 2])
    with record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
    routes = rec.routes
    perturb(qwen)
    with replay_routes(qwen, routes):
        whole = qwen(ids, attention_mask=mask).logits
    for idx in ([0, 1, 2], [5, 3], [4]):
        with replay_routes(qwen, routes[idx]):
            part = qwen(ids[idx], attention_mask=mask[idx]).logits
        torch.testing.assert_close(part, whole[idx], rtol=1e-5, atol=1e-6)
        with record_routes(qwen) as check, replay_routes(qwen, routes[idx]):
            qwen(ids[idx], attention_mask=mask[idx])
        assert check.routes.equal(routes[idx])


def test_scalar_tensor_index_keeps_batch_dim(qwen):
    ids, mask = left_padded(3, 5, [0, 1, 0])
    routes = recorded(qwen, ids, mask)
    import numpy as np

    for i in (torch.tensor(1), np.int64(1), 1):
        assert routes[i].shape == (1, 5, 2, 2) and torch.equal(routes[i].indices, routes.indices[1:2])


def test_replay_under_generate_with_cache(qwen):
    """Replay also applies step by step with a KV cache: forced experts at the recorded positions."""
    ids, mask = left_padded(2, 5, [0, 2])
    seq, routes = generate(qwen, ids, mask, n=4)
    perturb(qwen)
    with replay_routes(qwen, routes), record_routes(qwen) as rec:
        qwen.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=4, min_new_tokens=4, pad_token_id=PAD
        )
    # the prompt positions were fed identically, so their replayed routes match the recorded ones
    got = rec.routes
    prompt = routes.mask[:, :5]
    assert torch.equal(got.indices[:, :5][prompt], routes.indices[:, :5][prompt])


def test_saved_routes_replay(tmp_path, qwen):
    ids, mask = left_padded(2, 6, [1, 0])
    with record_routes(qwen) as rec:
        ref = qwen(ids, attention_mask=mask).logits
    rec.routes.save(tmp_path / "r.safetensors")
    with replay_routes(qwen, Routes.load(tmp_path / "r.safetensors")):
        assert torch.equal(qwen(ids, attention_mask=mask).logits, ref)


def test_more_than_256_experts_use_int16_and_replay_exactly():
    model = tiny_qwen3_moe(experts=300, top_k=4)
    ids, mask = left_padded(2, 6, [0, 2])
    with record_routes(model) as rec:
        ref = model(ids, attention_mask=mask).logits
    routes = rec.routes
    assert routes.indices.dtype == torch.int16 and int(routes.indices.max()) >= 256  # ids above uint8 survive
    with replay_routes(model, routes):
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)


def test_routes_named_by_another_engine_replay_by_layer_order(qwen):
    """Routes whose layer names match no router (another engine's) map by layer order when L, E and K agree."""
    ids, mask = left_padded(2, 6, [0, 1])
    with record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
    routes = rec.routes
    other = Routes(routes.indices, routes.mask, [LayerInfo(f"decoder.layers.{i}.mlp.router", 8, 2) for i in (0, 2)])
    perturb(qwen)
    with replay_routes(qwen, other), record_routes(qwen) as used:
        qwen(ids, attention_mask=mask)
    assert torch.equal(used.routes.indices[routes.mask], routes.indices[routes.mask])
    wrong_e = Routes(routes.indices, routes.mask, [LayerInfo(f"r.{i}", 16, 2) for i in range(2)])
    with pytest.raises(ReplayError, match="has E=8 experts but the routes hold E=16"):
        with replay_routes(qwen, wrong_e):
            qwen(ids, attention_mask=mask)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mask_contract_holds_for_every_cache_implementation(qwen, cache):
    """A static cache makes transformers pass a 4-D attention mask; left padding must still be unrecorded (on
    today's main the padding positions were marked as recorded)."""
    ids, mask = left_padded(3, 6, [2, 0, 1])
    torch.manual_seed(0)
    seq, routes = generate(qwen, ids, mask, n=4, cache_implementation=cache)
    assert torch.equal(routes.mask[:, :6], mask.bool())  # prompt padding: no route
    assert routes.mask[:, 6:-1].all() and not routes.mask[:, -1].any()  # generated tokens but the last sampled one
    agrees_with_teacher_forcing(routes, qwen, seq, extend_mask(mask, seq.shape[1]))


def test_a_replay_inside_a_recording_is_applied_and_the_recording_reads_outputs_again_after_it(
    qwen, monkeypatch, declared_path
):
    """A recording alone reads a declared router class's output (no call opened, no interception). A replay opened
    inside it must turn that off for its forwards (else it would not be applied, with no error) and on again when it
    closes."""
    opened = []
    begin = hooks_module.begin_call
    monkeypatch.setattr(hooks_module, "begin_call", lambda s, r: opened.append(r.index) or begin(s, r))
    ids, mask = left_padded(3, 6, [0, 2, 1])
    with record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
    routes = rec.routes
    perturb(qwen)
    with replay_routes(qwen, routes):
        replayed = qwen(ids, attention_mask=mask).logits
    with record_routes(qwen) as fresh:
        live = qwen(ids, attention_mask=mask).logits
    assert not fresh.routes.equal(routes)  # the perturbation moves some experts: a replay has something to change
    with record_routes(qwen) as outer:
        qwen(ids, attention_mask=mask)
        opened.clear()
        with replay_routes(qwen, routes):
            inside = qwen(ids, attention_mask=mask).logits
        calls_inside, opened[:] = len(opened), []
        after = qwen(ids, attention_mask=mask).logits
    assert torch.equal(inside, replayed) and torch.equal(after, live)
    assert calls_inside == 2 and opened == []  # a call per router under the replay, none after it
    before_r, inside_r, after_r = outer.batches
    assert before_r.equal(fresh.routes) and inside_r.equal(routes) and after_r.equal(fresh.routes)


def test_a_router_whose_forward_is_replaced_between_contexts_is_not_read_from_its_output(qwen):
    """The class is declared to return its top-k's indices; a forward replaced on the router instances after a
    context (here one that remaps the expert ids it returns, out of place) must have its top-k recorded, not its
    output: replaying the remapped ids would remap them again, with no error."""
    ids, mask = left_padded(2, 6, [0, 2])
    with torch.no_grad(), record_routes(qwen):
        qwen(ids, attention_mask=mask)
    perm = torch.roll(torch.arange(qwen.config.num_experts), 1)
    gates = [m for m in qwen.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    forward = type(gates[0]).forward

    def remapped(self, hidden):
        logits, scores, idx = forward(self, hidden)
        return logits, scores, perm[idx]

    for gate in gates:
        gate.forward = types.MethodType(remapped, gate)
    with torch.no_grad(), record_routes(qwen) as rec:
        recorded = qwen(ids, attention_mask=mask).logits
    with torch.no_grad(), replay_routes(qwen, rec.routes):
        replayed = qwen(ids, attention_mask=mask).logits
    assert torch.equal(replayed, recorded)


def test_a_router_with_a_method_set_on_it_does_not_run_its_class_methods():
    """`own_methods`: a method of the class replaced on the instance is not the declared class's code; a plain
    callable attribute that shadows nothing, or a submodule, is data."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = tiny_qwen3_moe().model.layers[-1].mlp.gate
    assert isinstance(router, Qwen3MoeTopKRouter) and own_methods(router)
    router.act, router.proj = torch.sigmoid, torch.nn.Linear(2, 2)
    assert own_methods(router)
    router.forward = lambda hidden: hidden
    assert not own_methods(router)


@pytest.mark.parametrize("which", ["indices", "mask"])
def test_routes_whose_tensors_are_replaced_during_a_replay_are_refused(qwen, which):
    """A replay converts its routes once per span and reuses that while they are unchanged (version counters). A
    tensor put in their place, whose version counter may equal the old one's, would be ignored: refused instead."""
    ids, mask = left_padded(2, 6, [0, 2])
    with torch.no_grad(), record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
    routes = rec.routes
    with torch.no_grad(), replay_routes(qwen, routes):
        qwen(ids, attention_mask=mask)
        setattr(routes, which, getattr(routes, which).clone())  # (a fresh tensor: version 0, as the old one)
        with pytest.raises(ReplayError, match="replaced by another tensor"):
            qwen(ids, attention_mask=mask)
