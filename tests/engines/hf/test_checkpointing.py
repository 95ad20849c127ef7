"""Replay under activation checkpointing from any source, and recomputes that take the plan of the forward they
re-run in any backward order (nested replays, gradient accumulation)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from helpers import left_padded, perturb, recorded, tiny_qwen3_moe
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

from moe_replay import ReplayError, Routes, replay_routes
from moe_replay.layers import plain_name


@pytest.fixture(scope="module")
def setup():
    """A model whose routers moved after its routes were recorded (as after an optimizer step), in train mode."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(3, 7, [0, 2, 0])
    routes = recorded(model, ids, mask)
    perturb(model)
    return model.train(), ids, mask, routes


def grads(model, ids, mask, routes) -> dict[str, torch.Tensor]:
    """Gradients of one replayed forward + backward, by parameter name without wrapper segments."""
    model.zero_grad(set_to_none=True)
    with replay_routes(model, routes):  # no KV cache: a recompute would append to it again (as in any training)
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    named = model.named_parameters()
    return {plain_name(n).replace(".inner.", "."): p.grad.clone() for n, p in named if p.grad is not None}


class Checkpointed(nn.Module):
    """A user's own wrapper: `torch.utils.checkpoint.checkpoint` around a decoder layer."""

    def __init__(self, layer: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = layer, reentrant

    def forward(self, *args, **kwargs):
        return checkpoint(partial(self.inner, **kwargs), *args, use_reentrant=self.reentrant)


def torch_wrapper(model, impl):
    wrap = partial(checkpoint_wrapper, checkpoint_impl=impl)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, Qwen3MoeDecoderLayer)
    )


def own_wrapper(model, reentrant):
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = Checkpointed(layer, reentrant)


def composable(model):
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for layer in model.model.layers:
        composable_checkpoint(layer)


def hf_flag(model, reentrant):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


CHECKPOINTING = {
    "checkpoint_wrapper-reentrant": partial(torch_wrapper, impl=CheckpointImpl.REENTRANT),
    "checkpoint_wrapper-no_reentrant": partial(torch_wrapper, impl=CheckpointImpl.NO_REENTRANT),
    "utils.checkpoint-reentrant": partial(own_wrapper, reentrant=True),
    "utils.checkpoint-no_reentrant": partial(own_wrapper, reentrant=False),
    "composable": composable,
    "transformers-reentrant": partial(hf_flag, reentrant=True),
    "transformers-no_reentrant": partial(hf_flag, reentrant=False),
}


@pytest.mark.parametrize("how", list(CHECKPOINTING))
def test_any_activation_checkpointing_replays_in_the_recompute(setup, how):
    """The recompute inside loss.backward() replays the forward's routes whoever put the checkpoint there, so the
    gradients equal the run without checkpointing (on today's main torch's checkpoints recomputed live: 34 of 36
    gradients differed, or torch raised CheckpointError)."""
    model, ids, mask, routes = setup
    expected = grads(model, ids, mask, routes)
    wrapped = copy.deepcopy(model)
    CHECKPOINTING[how](wrapped)
    got = grads(wrapped, ids, mask, routes)  # wrapped names (`..._checkpoint_wrapped_module...`) match the routes'
    assert_same_grads(got, expected)


def summed(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_nested_replays_recompute_their_own_plans_in_any_backward_order(reentrant, order):
    """Two forwards under nested replays of different routes, then both backwards: each recompute takes the plan of
    the forward it re-runs (today's main gave the outer forward's recompute the inner plan in forward order)."""
    model = tiny_qwen3_moe()
    a, _ = left_padded(2, 6, [0, 0], seed=1)
    b, _ = left_padded(2, 6, [0, 0], seed=2)
    ones = torch.ones_like(a)
    ra, rb = recorded(model, a, ones), recorded(model, b, ones)
    perturb(model)
    model.train()
    model.zero_grad(set_to_none=True)
    for r, x in ((ra, a), (rb, b)):  # expected: each replayed forward + backward on its own, no checkpointing
        with replay_routes(model, r):
            model(x, labels=x).loss.backward()
    expected = summed(model)
    model.zero_grad(set_to_none=True)
    hf_flag(model, reentrant)
    with replay_routes(model, ra):
        losses = [model(a, labels=a).loss]
        with replay_routes(model, rb):
            losses.append(model(b, labels=b).loss)
            for k in order:
                losses[k].backward()
    assert_same_grads(summed(model), expected)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_accumulated_forwards_of_one_context_recompute_their_own_plans(setup, order):
    """Gradient accumulation: two forwards of one context (the full batch, then its first 5 positions: different
    plans), then their backwards in either order."""
    model, ids, mask, routes = setup
    model = copy.deepcopy(model)
    parts = [(ids, mask), (ids[:, :5], mask[:, :5])]
    prefix = Routes(routes.indices, routes.mask & (torch.arange(routes.seq_len) < 5), routes.layers)
    model.zero_grad(set_to_none=True)
    for (x, m), r in zip(parts, (routes, prefix), strict=True):
        with replay_routes(model, r):
            model(x, attention_mask=m, labels=x).loss.backward()
    expected = summed(model)
    model.zero_grad(set_to_none=True)
    hf_flag(model, reentrant=False)
    with replay_routes(model, routes):
        losses = [model(x, attention_mask=m, labels=x).loss for x, m in parts]
        for k in order:
            losses[k].backward()
    assert_same_grads(summed(model), expected)


def test_a_recompute_that_matches_no_waiting_forward_is_an_error(setup):
    """If the recompute's router input matches none of the waiting forwards (it was changed in between), replay
    refuses rather than guess."""
    model, ids, mask, routes = setup
    model = copy.deepcopy(model)
    hf_flag(model, reentrant=False)
    with pytest.raises(ReplayError, match="cannot tell which forward it re-runs"):
        with replay_routes(model, routes):
            first = model(ids, attention_mask=mask, labels=ids).loss
            second = model(ids.flip(0), attention_mask=mask.flip(0), labels=ids).loss
            with torch.no_grad():  # the recompute of layer 0 now sees other router inputs than either forward
                model.model.layers[0].post_attention_layernorm.weight.mul_(1.5)
            (first + second).backward()


def test_a_checkpoint_that_is_not_recognised_is_an_error_not_a_live_recompute(setup):
    """Saved-tensor hooks of another tool inside a non-reentrant checkpoint hide it from the router call: the
    forward's plan is not queued, so the recompute raises instead of routing live (which would be silently wrong as
    soon as anything after the router is saved under the checkpoint)."""
    model, ids, mask, routes = setup
    model = copy.deepcopy(model)

    class Offloaded(Checkpointed):
        def forward(self, *args, **kwargs):
            def run(*a):
                with torch.autograd.graph.save_on_cpu():  # the layer runs under other hooks: the router too
                    out = self.inner(*a, **kwargs)
                return out * (1 + out.detach().tanh() * 1e-3)  # saves the layer's output under the checkpoint

            return checkpoint(run, *args, use_reentrant=False)

    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = Offloaded(layer, reentrant=False)
    with pytest.raises(ReplayError, match="no replayed forward awaits it"):
        with replay_routes(model, routes):
            model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()


class Toggle(nn.Module):
    """A checkpoint that can be switched off (the reference run), around any module."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant, self.on = inner, reentrant, False

    def forward(self, *args, **kwargs):
        if not self.on:
            return self.inner(*args, **kwargs)
        return checkpoint(partial(self.inner, **kwargs), *args, use_reentrant=self.reentrant)


class Twice(nn.Module):
    """A looped layer: the same decoder layer run twice (its router is recorded as `name` and `name#1`)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden, *args, **kwargs):
        return self.layer(self.layer(hidden, *args, **kwargs), *args, **kwargs)


def replayed_grads(model, ids, mask, routes, *, retain=False):
    model.zero_grad(set_to_none=True)
    with replay_routes(model, routes):
        loss = model(ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward(retain_graph=retain)
        if retain:  # a second backward through the same graph recomputes again
            loss.backward()
    return summed(model)


@pytest.mark.parametrize("reentrant", [True, False])
def test_looped_layer_inside_one_checkpoint_and_a_second_backward(reentrant):
    """One checkpoint re-runs a looped router's two calls in forward order, each with its own plan; a second
    backward (retain_graph) recomputes them again (found by review: the plans were swapped, 12 of 25 gradients)."""
    model = tiny_qwen3_moe(layers=2)
    model.model.layers[0] = Toggle(Twice(model.model.layers[0]), reentrant)
    ids, mask = left_padded(2, 6, [0, 0])
    routes = recorded(model, ids, mask)
    assert routes.layer_names[:2] == ["model.layers.0.inner.layer.mlp.gate", "model.layers.0.inner.layer.mlp.gate#1"]
    perturb(model)
    model.train()
    for retain in (False, True):
        expected = replayed_grads(model, ids, mask, routes, retain=retain)
        model.model.layers[0].on = True
        assert_same_grads(replayed_grads(model, ids, mask, routes, retain=retain), expected)
        model.model.layers[0].on = False


def test_no_grad_inside_a_forward_is_not_a_checkpoint_and_a_raised_forward_leaves_nothing_waiting(setup):
    """A frozen layer run under torch.no_grad() inside a forward with grad is not recomputed: nothing may wait for
    it at exit. A forward that raised under checkpointing is never backwarded: nothing of it may wait either."""
    model, ids, mask, routes = setup
    model = copy.deepcopy(model)

    class Frozen(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            with torch.no_grad():
                return self.inner(*args, **kwargs)

    frozen = copy.deepcopy(model)
    frozen.model.layers[0] = Frozen(frozen.model.layers[0])
    replayed_grads(frozen, ids, mask, recorded(frozen, ids, mask))  # exits cleanly
    hf_flag(model, reentrant=False)
    boom = model.model.layers[2].register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with replay_routes(model, routes):
        with pytest.raises(RuntimeError, match="boom"):
            model(ids, attention_mask=mask, labels=ids)
        boom.remove()
        model(ids, attention_mask=mask, labels=ids).loss.backward()  # the retry; the context then exits cleanly


def test_a_recompute_of_a_forward_outside_the_replay_is_refused(setup):
    """A checkpointed forward run live before the context, backwarded inside it, must not take the plan of the
    context's own waiting forward (found by review: all 36 gradients wrong, no error)."""
    model, ids, mask, routes = setup
    model = copy.deepcopy(model)
    hf_flag(model, reentrant=False)
    other = ids.flip(0)
    live = model(other, attention_mask=mask.flip(0), labels=other).loss
    with pytest.raises(ReplayError, match="matches none of the 1 replayed calls"):
        with replay_routes(model, routes):
            model(ids, attention_mask=mask, labels=ids)
            live.backward()


def test_selective_activation_checkpointing_and_a_checkpoint_around_the_whole_model(setup):
    """torch's selective activation checkpointing (a policy that saves some ops) and a reentrant checkpoint around
    the whole model call: the recompute replays the forward's plan."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    model, ids, mask, routes = setup
    model = copy.deepcopy(model)
    expected = replayed_grads(model, ids, mask, routes)

    def policy(ctx, op, *args, **kwargs):
        saved = (torch.ops.aten.topk.default, torch.ops.aten.mm.default)
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    for layer in model.model.layers:
        layer.forward = partial(
            checkpoint,
            layer.forward,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, policy),
        )
    assert_same_grads(replayed_grads(model, ids, mask, routes), expected)
    whole = copy.deepcopy(setup[0])
    whole.model.embed_tokens.weight.requires_grad_(True)
    whole.zero_grad(set_to_none=True)
    with replay_routes(whole, routes):
        embeds = whole.model.embed_tokens(ids)  # a reentrant checkpoint needs an input that requires grad
        loss = checkpoint(
            lambda e: whole(inputs_embeds=e, attention_mask=mask, labels=ids, use_cache=False).loss,
            embeds,
            use_reentrant=True,
        )
        loss.backward()
    assert_same_grads(summed(whole), expected)
