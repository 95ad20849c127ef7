"""Hook hygiene: hook counts before, inside and after contexts (nested ones share the model's hooks), every hook
removed after a forward that raised or a recorder's error at the context's exit, and no cyclic garbage left by
contexts and their router calls."""

from __future__ import annotations

import pytest
import torch
from helpers import PAD, hook_count, left_padded, recorded

from moe_replay import record_routes, replay_routes


def test_hook_counts_before_inside_after_and_nested(qwen, path):
    before = hook_count(qwen)
    assert before == 0
    ids, mask = left_padded(2, 5, [0, 1])
    with record_routes(qwen) as rec:
        inside = hook_count(qwen)
        # patched forwards: the causal LM and its inner base model (2), each router (2 MoE layers) and, on the general
        # path, its MoE block (a declared router's top-k runs inside it); and the causal LM's generate
        assert inside == 2 + 2 * (1 if path == "auto" else 2) + 1
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


def test_a_recorder_error_on_held_steps_at_exit_still_removes_every_hook(qwen, monkeypatch):
    """Decode steps still held when the context closes are handed over there: a recorder's error on them, raised
    there, leaves no hook behind. (A `generate` that raised drops its steps: kept here, as if it had not, to have
    steps held at the exit.)"""
    from moe_replay.engines.hf.record import RouteRecorder
    from moe_replay.engines.hf.session import Session

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
    monkeypatch.setattr(Session, "drop_streams", lambda self, first: None)
    with pytest.raises(ValueError, match="refused decode step"), torch.no_grad(), record_routes(qwen):
        qwen.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD, streamer=Stop())
    assert hook_count(qwen) == 0 and "_moe_replay_hub" not in qwen.__dict__


def test_contexts_and_router_calls_leave_no_cyclic_garbage(qwen):
    """Everything a context and its router calls make is freed when they end (no reference cycles): the replayed
    index tensors are not held until a garbage collection, and a context per forward does not keep triggering one."""
    import gc

    ids, mask = left_padded(2, 5, [0, 1])
    routes = recorded(qwen, ids, mask)

    def work() -> None:
        with torch.no_grad(), record_routes(qwen) as rec:
            qwen.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
        assert rec.routes.batch_size == 2
        with replay_routes(qwen, routes, track_live=True):
            qwen(ids, attention_mask=mask).logits.sum().backward()

    work()  # first use (torch's and transformers' own caches)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        work()
        work()
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("moe_replay")]
        tensors = sum(isinstance(o, torch.Tensor) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ours == [] and tensors == 0
