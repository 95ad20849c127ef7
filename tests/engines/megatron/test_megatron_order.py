"""Megatron-core replay that must not depend on the order things run in: recomputes in any backward order take their
own forward's routes, a list of Routes is used up by exactly as many forwards, and rollout-engine routes (no
multi-token-prediction column) leave the MTP router live. Each was silently wrong before (found by review)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

from megatron_utils import (  # noqa: E402
    EXPERTS,
    HIDDEN,
    TOP_K,
    VOCAB,
    batch,
    grads,
    micro_batch_routes,
    recompute_pair,
    set_weights,
    tiny_gpt,
)

from moe_replay import ReplayError  # noqa: E402
from moe_replay.engines.megatron import record_routes, replay_routes  # noqa: E402
from moe_replay.integrations.vllm import routes_from_vllm  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_process")  # one megatron-core CPU process (conftest.py)


@pytest.mark.parametrize("identical", [False, True], ids=["distinct", "identical"])
@pytest.mark.parametrize("order", ["in_order", "reversed", "summed"])
def test_recomputes_in_any_backward_order_take_their_own_forwards_routes(order, identical):
    """Two micro-batches forward under full recompute, then their backwards in order, in reverse order, or as one
    summed loss (autograd's order): each recompute takes the routes of its own forward, told by the checkpoint whose
    backward runs it; megatron's own queue hands them out first in, first out (found by review: 57 gradients wrong,
    no error). Identical micro-batches with other routes, whose router inputs agree until the routes differ, were
    refused as ambiguous (found by review: two equal GRPO answers under pipeline parallelism's 1F1B)."""
    plain, ckpt, micro, routes = recompute_pair(identical)

    def run(model):  # noqa: ANN001, ANN202
        model.zero_grad(set_to_none=True)
        with replay_routes(model, routes):
            losses = [model(t, p, m, labels=y).mean() for t, p, m, y in micro]
            if order == "summed":
                sum(losses).backward()
            else:
                for loss in losses if order == "in_order" else reversed(losses):
                    loss.backward()
        return grads(model)

    want, got = run(plain), run(ckpt)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_recompute_left_waiting_is_refused_unless_its_forward_was_dropped():
    """Under full recompute a forward with grad queues its calls for the backward: leaving the context before it
    raises while the loss could still be backwarded; a forward whose output was dropped (an old-log-prob pass kept
    detached) frees its checkpoints, so nothing is waited for (it raised)."""
    _, ckpt, micro, routes = recompute_pair()
    tokens, pos, mask, labels = micro[0]
    with pytest.raises(ReplayError, match="2 replayed router calls still wait for their recompute"):
        with replay_routes(ckpt, routes[0]):
            loss = ckpt(tokens, pos, mask, labels=labels)
    del loss
    with replay_routes(ckpt, routes[0]):
        logps = ckpt(tokens, pos, mask, labels=labels).detach()
    assert torch.isfinite(logps).all()


def test_more_routes_than_forwards_is_refused():
    """A list of three Routes used by two forwards gave them the first two micro-batches' routes."""
    model = tiny_gpt()
    micro = [batch(b=2, s=8, seed=s) for s in (0, 1, 2)]
    routes = micro_batch_routes(model, micro)
    with pytest.raises(ReplayError, match="routes were given for 3 forwards but 2 ran"):
        with torch.no_grad(), replay_routes(model, routes):
            for tokens, pos, mask, _ in micro[1:]:
                model(tokens, pos, mask)


def test_rollout_routes_leave_the_multi_token_prediction_router_live():
    """vLLM returns one column per decoder layer and none for an MTP layer: the import holds the decoder layers only
    (it gave the MTP router decoder layer 0's column), and the replay routes the MTP router live, so a model replaying
    its own decoder routes gets its own gradients."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K, moe_ffn_hidden_size=64, moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=True, add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, mtp_num_layers=1,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )  # fmt: skip
    set_weights(model, 0)
    tokens, pos, mask, labels = batch(b=2, s=8)
    with record_routes(model) as rec:
        model(tokens, pos, mask, labels=labels).mean().backward()
    own, expected = rec.routes, grads(model)
    assert own.layer_names[-1].startswith("mtp.layers.0.")
    model.zero_grad(set_to_none=True)
    outputs = [
        SimpleNamespace(
            prompt_token_ids=list(range(7)),
            outputs=[SimpleNamespace(index=0, token_ids=[0, 1], routed_experts=own.indices[b, :, :2].numpy())],
        )
        for b in range(2)
    ]
    imported = routes_from_vllm(outputs, model, seq_len=8)  # (the trainer's batch of 8: the last token not an input)
    assert imported.layer_names == own.layer_names[:2]
    with replay_routes(model, imported):
        model(tokens, pos, mask, labels=labels).mean().backward()
    got = grads(model)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
