"""Replayed calls that the backward will recompute belong to their context: a context closed before its backward is
refused, what a context queued leaves with it, and the next context starts with nothing waiting."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, perturb, recorded, tiny_qwen3_moe

from moe_replay import ReplayError, find_routers, replay_routes
from moe_replay.engines import recompute_queue as recompute
from moe_replay.engines.hf.patch import MARKER


def checkpointed(reentrant: bool):  # noqa: ANN201
    """A tiny model whose routers moved since its routes were recorded, in train mode with transformers' gradient
    checkpointing, with its inputs and routes."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    routes = recorded(model, ids, mask)
    perturb(model)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model, ids, mask, routes


def router_grads(model, ids, mask, routes) -> list[torch.Tensor]:  # noqa: ANN001
    """The router weights' gradients of one replayed forward and backward."""
    model.zero_grad(set_to_none=True)
    with replay_routes(model, routes):
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    return [s.router.weight.grad.clone() for s in find_routers(model)]


def queues_empty(model) -> bool:  # noqa: ANN001
    """Whether no call waits for its recompute in the session of the open contexts (none open: no session holds
    any, the hooks went with the last context)."""
    hub = model.__dict__.get(MARKER)
    return hub is None or all(queue.empty for queue in hub.session.queues())


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_context_closed_before_the_backward_of_a_checkpointed_forward_is_an_error(reentrant):
    """The recompute in the backward needs the context open: closing it first raises, naming the calls still waiting;
    the next context starts with nothing waiting and replays its own backward's recompute."""
    model, ids, mask, routes = checkpointed(reentrant)
    expected = router_grads(model, ids, mask, routes)
    with pytest.raises(ReplayError, match=r"\d+ replayed router calls still wait for their recompute"):
        with replay_routes(model, routes):
            loss = model(ids, attention_mask=mask, labels=ids, use_cache=False).loss  # (its backward may still run)
    assert queues_empty(model)  # its calls left with it
    del loss
    with replay_routes(model, routes):  # a forward whose graph is freed will never be recomputed: not waited for
        model(ids, attention_mask=mask, labels=ids, use_cache=False)
    got = router_grads(model, ids, mask, routes)
    assert all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_calls_a_context_queued_leave_with_it(reentrant):
    """The recomputed calls kept for a second backward (retain_graph) belong to their context: a nested replay's leave
    as it closes, while the outer context stays open, and the outer's as it closes (found by review: no test failed
    when they stayed)."""
    model, ids, mask, routes = checkpointed(reentrant)
    with replay_routes(model, routes):
        with replay_routes(model, routes):
            model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward(retain_graph=True)
            assert not queues_empty(model)  # kept for a second backward
        assert queues_empty(model)
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward(retain_graph=True)
        assert not queues_empty(model)
    assert queues_empty(model)


@pytest.mark.parametrize("reentrant", [True, False])
def test_recomputes_of_batches_of_64_that_share_their_first_token_take_their_own_plans(reentrant):
    """Two forwards of 64 rows each that share their first token, under nested replays of their own routes, then one
    backward: each recompute takes its forward's plan. Elements evenly spaced over such an input fell on each row's
    first position, alike in both forwards, so the recompute was refused as matching both (found by review)."""
    model = tiny_qwen3_moe()
    a, _ = left_padded(64, 5, [0] * 64, seed=1)
    b, _ = left_padded(64, 5, [0] * 64, seed=2)
    a[:, 0] = b[:, 0] = 3  # a BOS token
    ones = torch.ones_like(a)
    ra, rb = recorded(model, a, ones), recorded(model, b, ones)
    perturb(model)
    model.train()
    alone = [router_grads(model, x, ones, r) for x, r in ((a, ra), (b, rb))]  # each forward and backward alone
    expected = [g1 + g2 for g1, g2 in zip(*alone, strict=True)]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.zero_grad(set_to_none=True)
    with replay_routes(model, ra):
        loss = model(a, labels=a, use_cache=False).loss
        with replay_routes(model, rb):
            (loss + model(b, labels=b, use_cache=False).loss).backward()
    got = [s.router.weight.grad for s in find_routers(model)]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def all_grads(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "order, outer, inner",
    [("summed", None, i) for i in ("reentrant", "non_reentrant")]
    + [("summed", o, i) for o in ("reentrant", "non_reentrant") for i in ("reentrant", "non_reentrant")]
    + [("retain_graph", None, i) for i in ("reentrant", "non_reentrant")],
)
def test_forwards_of_identical_input_recompute_their_own_routes(order, outer, inner):
    """Two forwards of one batch, the routes' mask edited in place between them, then backwarded: each recompute takes
    the routes its own forward ran with, found by the checkpoint being recomputed. With transformers' per-layer
    checkpoints (`inner`), also inside a checkpoint around the whole model (`outer`, each kind around each), and with
    a forward's second backward (retain_graph) after the other forward. Found by review: the queued plans held a view
    of the mask, so the first forward's recompute took the edit (34 of 36 gradients wrong, no error); with the mask
    copied, identical inputs could not be told apart; a nested recompute then took the other forward's routes (12 of
    36 wrong, no error) or was falsely refused."""
    model, ids, mask, routes = checkpointed(inner == "reentrant")
    embeds = model.model.embed_tokens

    def loss() -> torch.Tensor:
        def run(e: torch.Tensor) -> torch.Tensor:
            return model(inputs_embeds=e, attention_mask=mask, labels=ids, use_cache=False).loss

        if outer is None:
            return model(ids, attention_mask=mask, labels=ids, use_cache=False).loss
        return torch.utils.checkpoint.checkpoint(run, embeds(ids), use_reentrant=outer == "reentrant")

    def grads_of_two(ckpt: bool) -> dict[str, torch.Tensor]:
        (model.gradient_checkpointing_enable if ckpt else model.gradient_checkpointing_disable)(
            **({"gradient_checkpointing_kwargs": {"use_reentrant": inner == "reentrant"}} if ckpt else {})
        )
        model.zero_grad(set_to_none=True)
        edited = type(routes)(routes.indices.clone(), routes.mask.clone(), routes.layers)
        with replay_routes(model, edited):
            first = loss()
            if order == "retain_graph":
                first.backward(retain_graph=True)
            edited.mask[0, 3:] = False  # the rest of row 0 routes live in the second forward
            second = loss()
            if order == "retain_graph":  # the first's second recompute while the second's call still waits
                first.backward()
                second.backward()
            else:
                (first + second).backward()
        return all_grads(model)

    want, got = grads_of_two(False), grads_of_two(True)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_live_forward_backwarded_inside_a_replay_is_refused_not_given_its_routes():
    """A checkpointed forward run with no context open and a replayed one of the same batch, backwarded together
    inside the replay: the live forward's recompute matched the replayed call by its sampled input elements (the
    routes differ from live routing at two tokens the samples miss) and took its routes (found by review: 12 of 36
    gradients wrong, no error). A reentrant checkpoint whose forward queued nothing is now refused."""
    model = tiny_qwen3_moe()
    perturb(model)
    ids, mask = left_padded(8, 32, [0] * 8, seed=3)
    routes = recorded(model, ids, mask)  # live routing, then two tokens of layer 0 swap one expert each
    a, b = routes.indices[3, 29, 0].tolist(), routes.indices[3, 30, 0].tolist()
    e1, e2 = next(e for e in a if e not in b), next(e for e in b if e not in a)
    routes.indices[3, 29, 0, a.index(e1)], routes.indices[3, 30, 0, b.index(e2)] = e2, e1
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    live = model(ids, labels=ids, use_cache=False).loss
    with pytest.raises(ReplayError, match="recomputed in the backward of a checkpoint whose forward replayed nothing"):
        with replay_routes(model, routes):
            (live + model(ids, labels=ids, use_cache=False).loss).backward()


def test_a_checkpointed_layer_that_needs_no_gradient_is_not_waited_for():
    """torch's non-reentrant `checkpoint_wrapper` on every layer, the first one frozen with the embeddings: its
    checkpoint saves nothing and is never recomputed, so its replayed call was waited for and the context refused to
    close (found by review); it is forgotten with its checkpoint, and the gradients are those
    without checkpoints."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = tiny_qwen3_moe()  # (not transformers' checkpointing: it makes the embeddings' output require grad)
    ids, mask = left_padded(2, 6, [0, 1])
    routes = recorded(model, ids, mask)
    perturb(model)
    model.train()
    for p in [*model.model.embed_tokens.parameters(), *model.model.layers[0].parameters()]:
        p.requires_grad_(False)
    want = all_grads_of_replay(model, ids, mask, routes)
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: type(m).__name__ == "Qwen3MoeDecoderLayer",
    )
    got = all_grads_of_replay(model, ids, mask, routes)
    assert {n.replace("_checkpoint_wrapped_module.", "") for n in got} == set(want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name.replace("_checkpoint_wrapped_module.", "")], rtol=1e-5, atol=1e-7)


def all_grads_of_replay(model, ids, mask, routes) -> dict[str, torch.Tensor]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    with replay_routes(model, routes):
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    return all_grads(model)


def grads_of_forwards_backwarded_twice(model, ids, mask, routes, n: int, reentrant: bool | None):  # noqa: ANN001
    """The gradients of `n` replayed forwards, each with a different mask (positions left out route live), summed and
    backwarded twice (retain_graph): with transformers' gradient checkpointing of the given kind, or none."""
    if reentrant is None:
        model.gradient_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.zero_grad(set_to_none=True)
    edited = type(routes)(routes.indices.clone(), routes.mask.clone(), routes.layers)
    with replay_routes(model, edited):
        losses = []
        for k in range(n):
            left_out = torch.tensor([(k >> b) & 1 for b in range(mask.numel())], dtype=torch.bool).view(mask.shape)
            edited.mask.copy_(routes.mask & ~left_out)
            losses.append(model(ids, attention_mask=mask, labels=ids, use_cache=False).loss)
        total = sum(losses)
        total.backward(retain_graph=True)
        total.backward()
    return all_grads(model)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_second_backward_over_more_checkpointed_forwards_than_the_old_limit_recomputes_each_one(reentrant):
    """20 checkpointed forwards of one replay, each with its own routes, backwarded twice: every recompute of the
    second backward takes its own forward's routes again (16 recomputed calls were kept per router before: the
    second backward was refused, naming a wrong cause)."""
    model, ids, mask, routes = checkpointed(reentrant)
    want = grads_of_forwards_backwarded_twice(model, ids, mask, routes, 20, None)
    got = grads_of_forwards_backwarded_twice(model, ids, mask, routes, 20, reentrant)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_second_backward_over_more_checkpointed_forwards_than_are_kept_is_refused_saying_so(monkeypatch, reentrant):
    """Past `KEEP_DONE` recomputed calls per router, the second backward cannot place the calls let go: refused, with
    that named as the cause."""
    monkeypatch.setattr(recompute, "KEEP_DONE", 4)
    model, ids, mask, routes = checkpointed(reentrant)
    with pytest.raises(ReplayError, match="recomputed calls of this router were let go while their checkpoints"):
        grads_of_forwards_backwarded_twice(model, ids, mask, routes, 6, reentrant)
