"""How a recorder keeps a recorded batch (stream.py): indices held as the routers returned them and copied a block of
steps at a time, joined into [B, T, L, K] whatever blocks they came in, and every problem found while copying raised
when the routes are built, naming the router."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import tiny_qwen3_moe
from torch.utils._python_dispatch import TorchDispatchMode

from moe_replay import UnsupportedModelError, record_routes, replay_routes
from moe_replay.engines.hf import RouteRecorder
from moe_replay.engines.hf import stream as stream_module
from moe_replay.engines.hf.steps import Step
from moe_replay.engines.hf.stream import Stream

B, K, E = 2, 2, 8
LAYERS = ["a", "b", "c"]


def expected(T: int) -> torch.Tensor:
    """Distinct indices [B, T, L, K] (values mod E)."""
    return torch.arange(B * T * len(LAYERS) * K).reshape(B, T, len(LAYERS), K) % E


def feed(stream: Stream, truth: torch.Tensor, lengths: list[int], shape: str = "flat", order=None) -> None:  # noqa: ANN001
    """Hand `stream` steps of `lengths` positions whose router calls return `truth`'s indices, in `shape`:
    "flat" [B*t, K], "3d" [B, t, K], "mixed" (alternating by layer); layers in `order` (default LAYERS)."""
    start, names = 0, tuple(order or LAYERS)
    for t in lengths:
        pieces = []
        for name in names:
            piece = truth[:, start : start + t, LAYERS.index(name)]  # [B, t, K]
            flat = shape == "flat" or (shape == "mixed" and LAYERS.index(name) % 2)
            piece = (piece.reshape(B * t, K) if flat else piece).clone()  # a fresh tensor, as a router returns
            if t == 1 and flat:
                piece = piece.reshape(B, K)
            pieces.append(piece)
        versions = tuple(p._version for p in pieces)
        stream.take(
            Step(0, B, start, t, None, torch.device("cpu")), names, tuple(pieces), versions, dict.fromkeys(LAYERS, E)
        )
        start += t


@pytest.mark.parametrize("shape", ["flat", "3d", "mixed"])
def test_steps_join_into_the_routes_layout_whatever_blocks_they_were_copied_in(monkeypatch, shape):
    monkeypatch.setattr(stream_module, "HOLD", 3)
    truth = expected(12)
    stream = Stream(B)
    feed(stream, truth, [4, 1, 1, 1, 1, 1, 2, 1], shape)  # a prefill, decode steps (3 held at most), a chunk of 2, ...
    assert [(b.start, b.indices.shape[1]) for b in stream.blocks] == [(0, 4), (4, 3), (7, 2), (9, 2)]
    assert len(stream.held) == 1  # the last decode step, not copied yet
    indices, mask = stream.indices(LAYERS, dict.fromkeys(LAYERS, E), 13)  # and one more position, never forwarded
    assert torch.equal(indices[:, :12], truth.to(torch.uint8)) and indices.is_contiguous()
    assert mask[:, :12].all() and not mask[:, 12].any() and not indices[:, 12].any()
    assert indices.dtype == torch.uint8 and mask.shape == (B, 13)


def test_steps_whose_routers_ran_in_another_order_are_reordered_and_missing_ones_named():
    truth = expected(5)
    stream = Stream(B)
    feed(stream, truth, [3], order=["a", "b", "c"])
    feed_from = Stream(B)
    feed(feed_from, truth, [3, 1, 1], order=["c", "a", "b"])
    indices, _ = feed_from.indices(LAYERS, dict.fromkeys(LAYERS, E), 0)
    assert torch.equal(indices, truth.to(torch.uint8))
    short = Stream(B)
    feed(short, truth, [3, 1], order=["a", "c"])
    with pytest.raises(ValueError, match=r"routers \['b'\] recorded nothing at positions 0\.\.2"):
        short.indices(LAYERS, dict.fromkeys(LAYERS, E), 0)


def test_problems_found_while_copying_are_raised_when_the_routes_are_built():
    stream = Stream(B)
    truth = expected(2)
    feed(stream, truth, [1])
    stream.held[0][0][1].add_(1)  # layer b's indices edited in place before they were copied
    with pytest.raises(UnsupportedModelError, match="router 'b'.s top-k indices were changed in place"):
        stream.indices(LAYERS, dict.fromkeys(LAYERS, E), 0)
    uneven = Stream(B)
    pieces = tuple(torch.zeros(B, k, dtype=torch.long) for k in (2, 3, 2))
    uneven.take(Step(0, B, 0, 1, None, torch.device("cpu")), tuple(LAYERS), pieces, (0, 0, 0), dict.fromkeys(LAYERS, E))
    with pytest.raises(ValueError, match=r"layers recorded different top-k values \[2, 3\]"):
        uneven.indices(LAYERS, dict.fromkeys(LAYERS, E), 0)
    packed = Stream(B)  # a router that returned rows for real tokens alone
    packed.take(Step(0, B, 0, 4, None, torch.device("cpu")), ("a",), (torch.zeros(5, K),), (0,), {"a": E})
    with pytest.raises(UnsupportedModelError, match=r"router 'a' returned top-k indices of shape \(5, 2\) for a "):
        packed.indices(["a"], {"a": E}, 0)


class Ops(TorchDispatchMode):
    """Counts the tensor ops (ATen calls, views included) that moe-replay's own code issues."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        frame = sys._getframe(1)
        while frame is not None and "/torch/" in frame.f_code.co_filename:
            frame = frame.f_back
        self.count += frame is not None and "/moe_replay/" in frame.f_code.co_filename
        return func(*args, **(kwargs or {}))


def test_a_decode_step_adds_no_tensor_op_and_a_generate_records_what_its_steps_routed(declared_path):
    """Recording under `generate` issues the same tensor ops for 3 new tokens as for 20 (decode steps are copied
    `HOLD` at a time), and what it records is what a step-by-step copy records."""
    model = tiny_qwen3_moe()
    ids = torch.randint(5, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    counts, routes = [], []
    for new in (3, 3, 20):  # (the first learns the router's facts)
        with torch.no_grad(), record_routes(model) as rec, Ops() as ops:
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        counts.append(ops.count)
        routes.append(rec.routes)
    assert counts[1] == counts[2] > 0
    stepwise = []
    for hold in (1, stream_module.HOLD):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(stream_module, "HOLD", hold)
            with torch.no_grad(), record_routes(model) as rec:
                model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
        stepwise.append(rec.routes)
    assert stepwise[0].equal(stepwise[1]) and stepwise[1].equal(routes[2])


def model_ids_gate() -> tuple[torch.nn.Module, torch.Tensor, torch.nn.Module]:
    """A tiny Qwen3-MoE, a batch of ids for it, and the router of its layer 2 (layer 1 is dense)."""
    model = tiny_qwen3_moe()
    ids = torch.randint(5, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    return model, ids, model.model.layers[2].mlp.gate


def refused_or_reproduced(
    model: torch.nn.Module, ids: torch.Tensor, rec: RouteRecorder, edited: torch.Tensor, inference: bool
) -> bool:
    """For routes recorded over indices edited in place after their top-k selected them: under `no_grad` they are
    refused, naming the router; under inference mode (no edit is counted) the selection was recorded, so replaying
    it reproduces the edited forward (the edit applies again to the replayed experts). Returns whether they were
    refused."""
    if not inference:
        with pytest.raises(UnsupportedModelError, match="'model.layers.2.mlp.gate''s top-k indices were changed"):
            rec.routes  # noqa: B018
        return True
    with torch.inference_mode(), replay_routes(model, rec.routes):
        assert torch.equal(model(ids).logits, edited)
    return False


def test_a_forward_that_raised_records_nothing_and_an_edit_after_the_router_returned_is_refused():
    model, ids, gate = model_ids_gate()

    def boom(module, inputs, out) -> None:  # noqa: ANN001
        raise RuntimeError("boom")

    def zero(module, inputs, out) -> None:  # noqa: ANN001
        out[2].zero_()  # the indices the router returned, edited in place before the MoE block uses them

    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
        hook = gate.register_forward_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            model(ids)
        hook.remove()
        model(ids)
    first, second = rec.batches  # the forward that raised left nothing behind
    assert first.equal(second)
    with torch.no_grad(), record_routes(model) as rec:
        hook = gate.register_forward_hook(zero)
        model(ids)
        hook.remove()
    with pytest.raises(UnsupportedModelError, match="'model.layers.2.mlp.gate''s top-k indices were changed in place"):
        rec.routes  # noqa: B018


def test_a_generate_read_between_its_steps_holds_every_step_that_ran():
    """The hub hands a generate's decode steps to its recorders `HAND_OVER` at a time; the routes read between two
    steps (here by a streamer) hold every position forwarded so far, and what the generate records is unchanged by
    the reads or by handing over each step at once."""
    from moe_replay.engines.hf import steps as steps_module

    model = tiny_qwen3_moe()
    ids = torch.randint(5, 60, (2, 6), generator=torch.Generator().manual_seed(0))

    class Reader:
        def __init__(self, rec) -> None:  # noqa: ANN001
            self.rec, self.seen = rec, []

        def put(self, tokens: torch.Tensor) -> None:
            self.seen.append([r.indices.shape[1] for r in self.rec.batches])

        def end(self) -> None:
            pass

    def run(hand_over: int, read: bool):  # noqa: ANN202
        with pytest.MonkeyPatch.context() as mp, torch.no_grad(), record_routes(model) as rec:
            mp.setattr(steps_module, "HAND_OVER", hand_over)
            reader = Reader(rec) if read else None
            model.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=0, streamer=reader)
        return rec.routes, reader

    plain, _ = run(steps_module.HAND_OVER, read=False)
    each, _ = run(1, read=False)
    read, reader = run(steps_module.HAND_OVER, read=True)
    assert reader.seen[0] == [] and reader.seen[1:] == [[6 + k] for k in range(9)]
    assert plain.equal(each) and plain.equal(read) and plain.indices.shape[1] == 6 + 9


@pytest.mark.parametrize("known", [False, True], ids=["learning", "read_from_output"])
@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_an_edit_of_the_returned_indices_is_refused_or_not_recorded(known, inference):
    """The router's top-k indices are held as they are selected, in the model's first context (whose calls are
    intercepted) as in later ones (read from the router's output). An edit in place after that (here by a forward hook,
    before the MoE block uses them) is refused; under inference mode, whose tensors count no edits, the indices are
    copied as they are selected, so the edit is not recorded and replaying the routes reproduces the edited forward
    (the edit applies again to the replayed experts)."""
    model, ids, gate = model_ids_gate()
    E = model.config.num_experts
    mode = torch.inference_mode if inference else torch.no_grad
    if known:  # the router class's output index is known: its calls are read from the output (hub.py)
        with torch.no_grad(), record_routes(model):
            model(ids)

    def shift(module, inputs, out) -> None:  # noqa: ANN001
        out[2].add_(1).remainder_(E)  # other experts than the router picked

    hook = gate.register_forward_hook(shift)
    try:
        with mode(), record_routes(model) as rec:  # (the model's first context unless `known`)
            edited = model(ids).logits
        if refused_or_reproduced(model, ids, rec, edited, inference):
            return
    finally:
        hook.remove()
    with mode(), record_routes(model) as plain:
        model(ids)
    assert rec.routes.equal(plain.routes)


def test_a_phimoe_pick_edited_after_its_max_returned_is_refused():
    """PhiMoE picks its experts by per-token max calls (sparsemixer.py): each pick is held as the max returned it and
    joined when the call closes, so an edit in place between is refused, naming the router and the pick."""
    from types import SimpleNamespace

    from moe_replay.engines.hf.sparsemixer import SparsemixerPicks
    from moe_replay.engines.hf.stream import hold

    call = SimpleNamespace(step=SimpleNamespace(tokens=3), layer="model.layers.0.block_sparse_moe.gate")
    picks = SparsemixerPicks(call)
    first, second = torch.tensor([1, 2, 3]), torch.tensor([[0], [1], [2]])
    picks.picks = {0: hold(first), 1: hold(second)}
    joined, version = picks.picked()
    assert joined.tolist() == [[1, 0], [2, 1], [3, 2]] and version is None
    second.add_(1)
    with pytest.raises(UnsupportedModelError, match="'model.layers.0.block_sparse_moe.gate''s pick 1 was changed"):
        picks.picked()


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_a_router_class_that_edits_its_indices_before_returning_them_is_never_read_from_its_output(inference):
    """A router class whose forward edits its top-k's indices in place before returning them: what it returns is not
    what the top-k selected, so its calls are never recorded from its output (where the edit would be recorded, with
    no error), in its first context or any later one. Under `no_grad` the edit is refused when the indices are copied;
    under inference mode the selection is recorded, and replaying it reproduces the edited forward."""
    model, ids, gate = model_ids_gate()
    E = model.config.num_experts

    class Shifting(type(gate)):
        def forward(self, hidden_states: torch.Tensor) -> tuple:
            out = super().forward(hidden_states)
            out[2].add_(1).remainder_(E)  # other experts than its top-k picked
            return out

    gate.__class__ = Shifting
    mode = torch.inference_mode if inference else torch.no_grad
    for _ in range(2):  # the first context learns the class; the second would read its output
        with mode(), record_routes(model) as rec:
            edited = model(ids).logits
        refused_or_reproduced(model, ids, rec, edited, inference)
