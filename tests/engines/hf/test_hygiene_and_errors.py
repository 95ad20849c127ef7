"""Hook hygiene (counts before / inside / after, nesting, raising forwards) and bad input errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import PAD, hook_count, left_padded, perturb, recorded, tiny_qwen3_moe
from transformers import AutoModelForCausalLM, LlamaConfig

from moe_replay import (
    LayerInfo,
    ReplayError,
    Routes,
    UnsupportedGenerationError,
    UnsupportedModelError,
    keep_warm,
    record_routes,
    replay_routes,
)


def test_hook_counts_before_inside_after_and_nested(qwen):
    before = hook_count(qwen)
    assert before == 0
    ids, mask = left_padded(2, 5, [0, 1])
    with record_routes(qwen) as rec:
        inside = hook_count(qwen)
        # patched forwards: the causal LM and its inner base model (2), each router and its MoE block (2 x 2 MoE
        # layers); and the causal LM's generate
        assert inside == 2 + 2 * 2 + 1
        with replay_routes(qwen, recorded(qwen, ids, mask)):
            assert hook_count(qwen) == inside  # contexts share the model's hooks
            qwen(ids, attention_mask=mask)
        assert hook_count(qwen) == inside
    assert hook_count(qwen) == before
    assert "_moe_replay_hub" not in qwen.__dict__
    # the outer recorder saw both forwards (the one recorded inside, the replayed one): two batches of 2
    assert len(rec.batches) == 2 and rec.routes.batch_size == 4


def test_forward_that_raises_leaves_nothing_behind(qwen):
    ids, mask = left_padded(2, 5, [0, 1])
    boom = qwen.model.layers[2].mlp.experts.register_forward_pre_hook(lambda *a: 1 / 0)
    try:
        with pytest.raises(ZeroDivisionError):
            with record_routes(qwen):
                with replay_routes(qwen, recorded_without(qwen, boom, ids, mask)):
                    qwen(ids, attention_mask=mask)
    finally:
        boom.remove()
    assert hook_count(qwen) == 0
    assert torch._C._len_torch_function_stack() == 0  # no interception mode left pushed
    ref = qwen(ids, attention_mask=mask).logits  # the model still works, unhooked
    assert torch.isfinite(ref).all()


def recorded_without(model, handle, ids, mask):
    """Record with a temporarily disabled failing hook (used to build valid routes for the raising test)."""
    hooks = model.model.layers[2].mlp.experts._forward_pre_hooks
    saved = hooks.pop(handle.id)
    try:
        return recorded(model, ids, mask)
    finally:
        hooks[handle.id] = saved


def test_model_without_router_is_an_error():
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    dense = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM registers no router outputs"):
        with record_routes(dense):
            pass
    assert hook_count(dense) == 0


def test_wrong_batch_and_length(qwen):
    ids, mask = left_padded(3, 6, [0, 0, 2])
    routes = recorded(qwen, ids, mask)
    with pytest.raises(ReplayError, match="routes hold B=3 sequences but the forward has batch 2"):
        with replay_routes(qwen, routes):
            qwen(ids[:2], attention_mask=mask[:2])
    longer = torch.cat([ids, ids[:, :2]], 1)
    with pytest.raises(ReplayError, match=r"covers positions 0..7 but the routes hold T=6"):
        with replay_routes(qwen, routes):
            qwen(longer)
    assert hook_count(qwen) == 0


def test_unconsumed_routes_are_an_error(qwen):
    ids, mask = left_padded(2, 6, [0, 0])
    routes = recorded(qwen, ids, mask)
    with pytest.raises(ReplayError, match=r"left recorded routes unused: .* at positions \[4, 5\]"):
        with replay_routes(qwen, routes):
            qwen(ids[:, :4])
    with pytest.raises(ReplayError, match="never run"):
        with replay_routes(qwen, routes):
            pass
    # dropping positions whose routes are masked is fine (e.g. the last sampled token)
    trimmed = Routes(routes.indices, routes.mask.clone().index_fill_(1, torch.tensor([5]), False), routes.layers)
    with replay_routes(qwen, trimmed):
        qwen(ids[:, :5])


def test_other_layer_set_is_an_error(qwen):
    ids, mask = left_padded(2, 6, [0, 0])
    routes = recorded(qwen, ids, mask)
    deeper = tiny_qwen3_moe(layers=4)
    with pytest.raises(
        ReplayError, match=r"routes hold layers .* but Qwen3MoeForCausalLM has routers .*model.layers.3"
    ):
        with replay_routes(deeper, routes):
            pass
    # names that match no router map by layer order only when the layer count agrees (layers.match_layers)
    three = Routes(routes.indices[:, :, [0, 1, 1]], routes.mask, [LayerInfo(f"x.{i}", 8, 2) for i in range(3)])
    with pytest.raises(ReplayError, match=r"route layers without a router: \[.x.0., .x.1., .x.2.\]"):
        with replay_routes(qwen, three):
            pass
    half = Routes(routes.indices, routes.mask, [LayerInfo("x.0", 8, 2), LayerInfo(routes.layer_names[1], 8, 2)])
    with pytest.raises(ReplayError, match=r"route layers without a router: \[.x.0.\]"):
        with replay_routes(qwen, half):
            pass
    more_experts = Routes(routes.indices, routes.mask, [LayerInfo(n, 16, 2) for n in routes.layer_names])
    with pytest.raises(ReplayError, match="has E=8 experts but the routes hold E=16"):
        with replay_routes(qwen, more_experts):
            qwen(ids, attention_mask=mask)
    top3 = tiny_qwen3_moe(top_k=3)
    with pytest.raises(ReplayError, match=r"hold k=2 of E=8 experts .* top-k calls were \(E, k\) = \[\(8, 3\)\]"):
        with replay_routes(top3, routes):
            top3(ids, attention_mask=mask)
    assert hook_count(qwen) == hook_count(deeper) == hook_count(top3) == 0


def test_replay_rejects_non_routes(qwen):
    with pytest.raises(ValueError, match="needs a Routes, got Tensor"):
        replay_routes(qwen, torch.zeros(1, 1, 2, 2))


def test_beam_search_and_assisted_decoding_are_refused(qwen):
    ids, mask = left_padded(1, 4, [0])
    with pytest.raises(UnsupportedGenerationError, match="beam search"):
        with record_routes(qwen):
            qwen.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2, pad_token_id=PAD)
    with pytest.raises(UnsupportedGenerationError, match="assisted decoding"):
        with record_routes(qwen):
            qwen.generate(
                input_ids=ids, attention_mask=mask, prompt_lookup_num_tokens=2, max_new_tokens=2, pad_token_id=PAD
            )
    assert hook_count(qwen) == 0


def test_deepcopy_inside_a_context_gives_a_clean_independent_model(qwen):
    """A copy made while a context is open has no patched methods and no hub: it runs its own weights, and a later
    context on it records its own routes (on today's main its forwards still called the original model)."""
    import copy

    ids, mask = left_padded(2, 5, [0, 1])
    with record_routes(qwen) as rec:
        twin = copy.deepcopy(qwen)
        inner = copy.deepcopy(qwen.model)  # a part of the model, too
        qwen(ids, attention_mask=mask)
    assert hook_count(twin) == 0 and hook_count(inner) == 0 and hook_count(qwen) == 0
    assert not [k for m in (twin, inner) for k in m.__dict__ if k in ("_moe_replay_hub", "__deepcopy__")]
    assert "__deepcopy__" not in qwen.__dict__
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert not torch.equal(twin(ids).logits, qwen(ids).logits)  # the copy runs its own (zeroed) weights
    with record_routes(twin) as rec_twin:
        twin(ids, attention_mask=mask)
    assert rec_twin.routes.batch_size == 2 and len(rec.batches) == 1  # recorded by the copy's own context only
    with record_routes(inner) as rec_inner:
        inner(ids, attention_mask=mask)
    got, want = rec_inner.routes, rec.routes  # the inner copy routes like the original (names lack "model.")
    assert torch.equal(got.indices, want.indices) and torch.equal(got.mask, want.mask)


def test_a_shallow_copy_made_inside_a_context_is_not_left_with_a_dead_hub(qwen):
    """copy.copy shares the instance's patched methods and hub marker; a later context on the copy drops them and
    hooks it afresh (found by review: the copy's replay routed live until the exit check)."""
    import copy

    ids, mask = left_padded(2, 6, [0, 1])
    routes = recorded(qwen, ids, mask)
    perturb(qwen)
    with replay_routes(qwen, routes):
        want = qwen(ids, attention_mask=mask).logits
        shallow = copy.copy(qwen)
    with replay_routes(shallow, routes):
        assert torch.equal(shallow(ids, attention_mask=mask).logits, want)
    assert hook_count(shallow) == 0 and "_moe_replay_hub" not in shallow.__dict__


def test_a_model_saved_inside_a_context_is_clean_and_the_context_goes_on(qwen, tmp_path):
    """torch.save of the model, or of one layer, while a context is open (found by review: a PicklingError on the
    wrappers): the saved objects hold no patched method and no hub, route like the model, and the open context
    still records."""
    ids, mask = left_padded(2, 6, [0, 1])
    expected = recorded(qwen, ids, mask)
    with record_routes(qwen) as rec:
        torch.save(qwen, tmp_path / "model.pt")
        torch.save(qwen.model.layers[1], tmp_path / "layer.pt")
        qwen(ids, attention_mask=mask)
    assert rec.routes.equal(expected)
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    layer = torch.load(tmp_path / "layer.pt", weights_only=False)
    for module in (*loaded.modules(), *layer.modules()):
        assert not any(k.startswith("_moe_replay_hub") or k in ("forward", "__reduce_ex__") for k in module.__dict__)
    assert recorded(loaded, ids, mask).equal(expected)


@pytest.mark.parametrize("scoped", [False, True], ids=["cold", "keep_warm"])
def test_contexts_and_router_calls_leave_no_cyclic_garbage(qwen, scoped):
    """Everything a context and its router calls make is freed when they end (no reference cycles): the replayed
    index tensors are not held until a garbage collection, and a context per forward does not keep triggering one.
    Cold, the hub goes with the last context; in a `keep_warm` scope it goes when the scope closes."""
    import gc

    ids, mask = left_padded(2, 5, [0, 1])
    routes = recorded(qwen, ids, mask)

    def work() -> None:
        with torch.no_grad(), record_routes(qwen) as rec:
            qwen.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
        assert rec.routes.batch_size == 2
        with replay_routes(qwen, routes, track_live=True):
            qwen(ids, attention_mask=mask).logits.sum().backward()

    scope = keep_warm(qwen) if scoped else contextlib.nullcontext()
    work()  # first use (torch's and transformers' own caches)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with scope:
            work()
            work()
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("moe_replay")]
        tensors = sum(isinstance(o, torch.Tensor) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ours == [] and tensors == 0


def test_a_recorder_error_on_held_steps_at_exit_still_removes_every_hook(qwen, monkeypatch):
    """Decode steps still held when the context closes are handed over there: a recorder's error on them, raised
    there, leaves no hook behind. (A `generate` that raised drops its steps: kept here, as if it had not, to have
    steps held at the exit.)"""
    from moe_replay.engines.hf.hub import RouterHub
    from moe_replay.engines.hf.record import RouteRecorder

    def refuse(self, step, taken):  # noqa: ANN001, ANN202
        if step.start > 0:
            raise ValueError("refused decode step")

    class Stop:
        def __init__(self) -> None:
            self.n = 0

        def put(self, tokens: torch.Tensor) -> None:
            self.n += 1
            if self.n == 4:
                raise RuntimeError("stop")

        def end(self) -> None:
            pass

    ids, mask = left_padded(2, 5, [0, 1])
    with pytest.raises(RuntimeError, match="stop"), torch.no_grad(), record_routes(qwen) as rec:
        qwen.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD, streamer=Stop())
    assert rec.batches == [] and hook_count(qwen) == 0 and "_moe_replay_hub" not in qwen.__dict__
    monkeypatch.setattr(RouteRecorder, "record_step", refuse)
    monkeypatch.setattr(RouterHub, "drop_streams", lambda self, first: None)
    with pytest.raises(ValueError, match="refused decode step"), torch.no_grad(), record_routes(qwen):
        qwen.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD, streamer=Stop())
    assert hook_count(qwen) == 0 and "_moe_replay_hub" not in qwen.__dict__
