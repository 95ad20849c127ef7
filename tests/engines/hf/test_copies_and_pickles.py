"""A model copied (`copy.deepcopy`, `copy.copy`) or saved (`torch.save` of it or of one layer) while a context is
open: the copy or saved object is clean and independent, and the open context goes on."""

from __future__ import annotations

import torch
from helpers import hook_count, left_padded, perturb, recorded

from moe_replay import record_routes, replay_routes

OURS = ("__deepcopy__", "__reduce_ex__", "forward", "generate")  # what a context sets on a module's instance


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


def test_copies_and_pickles_of_copies_made_inside_a_context_are_clean_and_their_own(qwen):
    """With a context open: copy.copy, deepcopy and a pickle of the model hold nothing of moe-replay (found by review:
    copy hooks bound to the original went into a shallow copy or a pickle, whose own copies then were of the
    original), and a copy of such a copy is of that copy."""
    import copy
    import pickle

    ids, mask = left_padded(2, 6, [0, 1])
    expected = recorded(qwen, ids, mask)
    with record_routes(qwen) as rec:
        copies = [copy.copy(qwen), copy.deepcopy(qwen), pickle.loads(pickle.dumps(qwen))]
        qwen(ids, attention_mask=mask)
    assert rec.routes.equal(expected)
    for twin in copies:
        assert not [k for m in twin.modules() for k in m.__dict__ if k.startswith("_moe_replay") or k in OURS]
        twin.tag = "the copy"
        assert copy.deepcopy(twin).tag == "the copy" and pickle.loads(pickle.dumps(twin)).tag == "the copy"
        assert recorded(twin, ids, mask).equal(expected)
    assert not [k for m in qwen.modules() for k in m.__dict__ if k.startswith("_moe_replay") or k in OURS]
