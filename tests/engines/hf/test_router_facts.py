"""What contexts learn about each router class (where its top-k runs, which output holds the indices): top-k
interception narrows to the router once learned, and what is learned is kept for the next context only inside a
`keep_warm` scope on that model."""

from __future__ import annotations

import types

import torch
from helpers import left_padded, own_choice_forward, perturb, recorded, tiny_qwen3_moe

from moe_replay import keep_warm, record_routes, replay_routes


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
            facts = scope.facts  # learned per model, per router and training mode
            assert facts and all(f.topk_in_router == {False: expected} for f in facts.values())
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
        facts = scope.facts.values()  # eval: output 2 is the indices
        assert facts and all(f.topk_in_router == {False: True} and f.output_index == {False: 2} for f in facts)
        assert recorded(qwen, ids, mask).equal(first)  # the next context starts from the facts (reads output 2)
        other = tiny_qwen3_moe()
        with keep_warm(other) as theirs:
            assert theirs.facts == {}  # another model of the same classes learns its own
            assert recorded(other, ids, mask).equal(first)
    assert set(qwen.__dict__) == before


def test_a_block_that_selects_on_its_own_is_learned_for_its_router_alone(qwen, monkeypatch):
    """Layer 0's MoE block selects its experts itself; layer 2's is the stock block, whose router selects. Inside
    `keep_warm`, every context records and replays what the general path does (found by review: the last router to
    run set its class's fact to "top-k inside the router", and the next context left layer 0's block unwrapped, so
    its own choice went unrecorded and unreplayed, with no error)."""
    block = qwen.model.layers[0].mlp
    block.forward = types.MethodType(own_choice_forward, block)
    ids, mask = left_padded(2, 5, [0, 1])
    routes = recorded(qwen, ids, mask)
    perturb(qwen)

    def replayed() -> torch.Tensor:
        with replay_routes(qwen, routes), torch.no_grad():
            return qwen(ids, attention_mask=mask).logits

    monkeypatch.setenv("MOE_REPLAY_PATH", "general")
    want_routes, want_logits = recorded(qwen, ids, mask), replayed()
    assert not want_routes.indices.equal(routes.indices)  # (the perturbed model routes otherwise live)
    monkeypatch.delenv("MOE_REPLAY_PATH")
    with keep_warm(qwen) as scope:
        for _ in range(3):
            assert recorded(qwen, ids, mask).equal(want_routes)
            assert torch.equal(replayed(), want_logits)
        facts = {name: f.topk_in_router for name, f in scope.facts.items()}
        assert facts == {"model.layers.0.mlp.gate": {False: False}, "model.layers.2.mlp.gate": {False: True}}
