"""Contexts themselves: reusable once closed; one open on a model or on its inner model at a time (an overlap is
refused, a call of the inner model is a step of its own); and the thread they belong to (another thread's forward or
context while one is open is refused)."""

from __future__ import annotations

import pytest
import torch
from helpers import hook_count, left_padded

from moe_replay import ReplayError, record_routes, replay_routes


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


def test_inner_model_call_is_its_own_step(qwen):
    ids, mask = left_padded(2, 5, [0, 1])
    with record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
        qwen.model(ids, attention_mask=mask)
    assert len(rec.batches) == 2 and all("#" not in n for n in rec.routes.layer_names)


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
