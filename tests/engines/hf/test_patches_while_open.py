"""Routers and MoE blocks patched while a record/replay context is open on the model. The open contexts' hooks were
set for the code that ran when they opened: a patch they cannot follow must be refused with a ReplayError at the next
router call, else the hooks must run what they hooked, so that the routes recorded are still the experts the blocks
used and a replay of them replays as recorded. Once the contexts close, the next one runs the patched code."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from families import build_tiny_model
from helpers import left_padded, own_choice_forward, perturb, tiny_qwen3_moe
from torch import nn
from transformers.models.qwen3_moe import modeling_qwen3_moe

from moe_replay import ReplayError, record_routes, replay_routes
from moe_replay.engines.hf.declared import ENV

REFUSED = "changed while a moe-replay context was open"


class OwnChoiceBlock(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock):
    """A block class that picks its own experts (the top-k of the negated router logits)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return own_choice_forward(self, hidden_states)


class NegatedRouter(modeling_qwen3_moe.Qwen3MoeTopKRouter):
    """A router subclass whose top-k picks the experts of the lowest scores."""

    def forward(self, hidden_states):  # noqa: ANN001, ANN201
        logits, _, _ = super().forward(hidden_states)
        values, indices = torch.topk((-logits).softmax(-1), self.top_k, dim=-1)
        return logits, values.to(logits.dtype), indices


class Rolled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.roll(1, 0)  # expert e scores with expert e-1's row


def patch(model, how: str, monkeypatch) -> None:  # noqa: ANN001
    """Patch every MoE layer of `model` as `how` says (a class patch is undone by `monkeypatch`)."""
    from torch.nn.utils import parametrize

    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    for block in blocks:
        if how == "router class swapped":
            block.gate.__class__ = NegatedRouter
        elif how == "router parametrized":
            parametrize.register_parametrization(block.gate, "weight", Rolled())
        elif how == "block class swapped":
            block.__class__ = OwnChoiceBlock
        elif how == "block forward set on the instance":
            block.forward = types.MethodType(own_choice_forward, block)
    if how == "block forward replaced on its class":
        monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock, "forward", own_choice_forward)


HOWS = [
    "router class swapped",
    "router parametrized",
    "block class swapped",
    "block forward set on the instance",
    "block forward replaced on its class",
]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("path", ["auto", "general"])
def test_a_router_or_block_patched_while_a_context_is_open_is_refused_or_runs_what_was_hooked(path, how, monkeypatch):
    """A stock Qwen3-MoE (its routers declared, unless MOE_REPLAY_PATH=general) is patched inside an open recording:
    the next forward is refused (the declared path refuses every one of these patches), or records the experts its
    blocks use; a recording opened after the contexts close records the experts the patched code uses."""
    monkeypatch.setenv(ENV, path)
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    got = []
    for m in model.modules():
        if isinstance(m, modeling_qwen3_moe.Qwen3MoeExperts):
            m.register_forward_pre_hook(lambda _m, args: got.append(args[1].clone()))

    def used() -> torch.Tensor:
        return torch.stack([g.reshape(*ids.shape, -1) for g in got[-2:]], 2).sort(-1).values

    def recorded(routes) -> torch.Tensor:  # noqa: ANN001
        return routes.indices.long().sort(-1).values[routes.mask]

    with torch.no_grad(), record_routes(model) as rec:
        model(ids, attention_mask=mask)
        stock = used()
        patch(model, how, monkeypatch)
        try:
            model(ids, attention_mask=mask)
        except ReplayError as e:
            assert REFUSED in str(e)
        else:
            assert path == "general", "not refused on the declared path"
            assert torch.equal(recorded(rec.batches[-1]), used()[mask.bool()])
    with torch.no_grad(), record_routes(model) as rec:
        model(ids, attention_mask=mask)
    assert torch.equal(recorded(rec.routes), used()[mask.bool()])
    assert not torch.equal(used(), stock)  # (the patch changed which experts run)


@pytest.mark.parametrize("path", ["auto", "general"])
def test_a_router_forward_replaced_on_its_class_while_a_context_is_open_runs_from_the_next_context(path, monkeypatch):
    """The open contexts' router hooks run the forward they hooked: inside them the replaced forward does not run and
    the routes are the experts used (a declared router refuses its changed class at its next call); the next context
    runs it."""
    monkeypatch.setenv(ENV, path)
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    stock, seen = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward, []

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(self)
        return stock(self, *args, **kwargs)

    with torch.no_grad(), record_routes(model) as rec:
        live = model(ids, attention_mask=mask).logits
        monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", counted)
        if path == "auto":
            with pytest.raises(ReplayError, match="changed while a moe-replay context was open"):
                with replay_routes(model, rec.batches[0]):
                    model(ids, attention_mask=mask)
        else:
            with replay_routes(model, rec.batches[0]):
                assert torch.equal(model(ids, attention_mask=mask).logits, live)
    assert seen == [] and rec.batches[-1].equal(rec.batches[0])
    with torch.no_grad(), record_routes(model) as again:
        model(ids, attention_mask=mask)
    assert len(seen) == 2 and again.routes.equal(rec.batches[0])


def test_a_name_in_the_router_s_module_patched_while_a_context_is_open_is_read_at_each_call(monkeypatch):
    """`F` of the Qwen3-MoE module (its `linear` tripled) replaced inside an open recording: a recording and a replay
    nested in it run the patched `F`, giving on the declared path what the general path gives."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    other = copy.deepcopy(model)
    perturb(other, scale=1.0)
    with torch.no_grad(), record_routes(other) as theirs:
        other(ids, attention_mask=mask)
    F = modeling_qwen3_moe.F
    tripled = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    tripled.linear = lambda x, w, b=None: 3 * F.linear(x, w, b)

    def inside(path: str) -> tuple[torch.Tensor, ...]:
        monkeypatch.setenv(ENV, path)
        with torch.no_grad(), record_routes(model):
            before = model(ids, attention_mask=mask).logits
            with monkeypatch.context() as m:
                m.setattr(modeling_qwen3_moe, "F", tripled)
                with record_routes(model) as rec:
                    live = model(ids, attention_mask=mask).logits
                with replay_routes(model, theirs.routes):
                    replayed = model(ids, attention_mask=mask).logits
        assert not torch.equal(live, before)  # (the patch changes the logits)
        return live, rec.routes.indices, replayed

    auto = inside("auto")
    assert all(torch.equal(a, b) for a, b in zip(auto, inside("general"), strict=True))


@pytest.mark.parametrize("path", ["auto", "general"])
def test_a_router_helper_patched_on_its_class_while_a_context_is_open_replays_as_recorded_or_is_refused(
    path, monkeypatch
):
    """LongCat-Flash's router returns what its `get_topk_indices` helper returns; the helper, patched on the class
    inside an open recording to remap the ids it returns, is recorded by a nested recording, then replayed: the
    replay must give the recorded logits, not remap the recorded ids again. The declared path refuses the changed
    class at its next call (found by review: it read the remapped ids, and a replay remapped them again)."""
    monkeypatch.setenv(ENV, path)
    model = build_tiny_model("longcat_flash").eval()
    ids = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    cls = next(type(m) for m in model.modules() if type(m).__name__ == "LongcatFlashTopkRouter")
    helper = cls.get_topk_indices

    def remapped(self, scores):  # noqa: ANN001, ANN202
        return (helper(self, scores) + 1) % self.n_routed_experts

    with torch.no_grad(), record_routes(model) as outer:
        model(ids)
        monkeypatch.setattr(cls, "get_topk_indices", remapped)
        if path == "auto":
            with pytest.raises(ReplayError, match="changed while a moe-replay context was open"):
                model(ids)
            return
        with record_routes(model) as rec:
            expected = model(ids).logits
        assert not torch.equal(rec.routes.indices, outer.batches[0].indices)  # (the patch changed the experts)
        with replay_routes(model, rec.routes):
            replayed = model(ids).logits
    assert torch.equal(replayed, expected)
