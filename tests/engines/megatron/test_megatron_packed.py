"""Packed (THD) sequences on megatron-core at CP = 1: the tests' attention-free GPT (tokens do not interact, learned
absolute positions restart per document) run on two right-padded sequences and on the same tokens packed in one row
with PackedSeqParams routes every token to the same experts; `to_packed` of the batch's routes replayed on the
packed row forces them (perturbed routers), giving the batch's per-token losses and router gradients. True THD
attention (Transformer Engine) is in scripts/megatron_cp_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

from cp_worker import packed_batch, packed_params, sequence_batch  # noqa: E402
from helpers import free_port  # noqa: E402
from megatron_utils import megatron_cpu, perturb_routers, tiny_gpt  # noqa: E402

from moe_replay import PackedRoutes, Routes, from_packed, replay_routes, to_packed  # noqa: E402
from moe_replay.engines.megatron import record_routes  # noqa: E402
from moe_replay.errors import ReplayError  # noqa: E402


def router_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("router.weight")}


def test_packed_row_routes_and_replays_as_the_batch():
    seq = sequence_batch()
    packed, keep, cu, cu_padded = packed_batch()
    params = packed_params(cu, cu_padded)
    with megatron_cpu(port=free_port()):
        model = tiny_gpt(attention=False)
        with record_routes(model) as rec:
            model(seq["tokens"], seq["position_ids"], None)
        recorded = rec.routes
        batch_routes = Routes(recorded.indices, recorded.mask & keep.bool(), recorded.layers)  # tokens only
        with record_routes(model) as rec:
            model(packed["tokens"], packed["position_ids"], None, packed_seq_params=params)
        on_row = rec.routes
        # a recording under PackedSeqParams knows its row's sequences (found by review: it came back as plain Routes,
        # so its replay on an unpacked forward was not checked)
        assert isinstance(on_row, PackedRoutes)
        assert on_row.cu_seqlens == tuple(cu.tolist()) and on_row.cu_seqlens_padded == tuple(cu_padded.tolist())
        with pytest.raises(ReplayError, match="without PackedSeqParams"), torch.no_grad(), replay_routes(model, on_row):
            model(packed["tokens"], packed["position_ids"], None)
        with torch.no_grad(), replay_routes(model, on_row):
            model(packed["tokens"], packed["position_ids"], None, packed_seq_params=params)
        with record_routes(model) as two:
            for _ in range(2):
                model(packed["tokens"], packed["position_ids"], None, packed_seq_params=params)
        assert all(isinstance(b, PackedRoutes) for b in two.batches)
        with pytest.raises(ValueError, match="packed rows of several forwards do not join"):
            _ = two.routes
        # every token is routed as in the batch: packing the batch's routes gives the row's, token for token
        mine = to_packed(batch_routes, keep, multiple=4)
        assert torch.equal(mine.cu_seqlens, cu) and torch.equal(mine.cu_seqlens_padded, cu_padded)
        tokens = mine.routes.mask[0]
        assert int(tokens.sum()) == int(keep.sum())
        assert torch.equal(on_row.indices[0, tokens], mine.routes.indices[0, tokens])
        assert from_packed(on_row, cu, keep, cu_seqlens_padded=cu_padded).equal(batch_routes)

        perturb_routers(model)
        with record_routes(model) as live:
            model(packed["tokens"], packed["position_ids"], None, packed_seq_params=params)
        assert not torch.equal(live.routes.indices[0, tokens], mine.routes.indices[0, tokens])
        with replay_routes(model, batch_routes):
            loss = model(seq["tokens"], seq["position_ids"], None, labels=seq["labels"])
            (loss * keep).sum().backward()
        expected, expected_grads = loss.detach()[keep.bool()], router_grads(model)
        model.zero_grad()
        with replay_routes(model, mine.routes):  # (the padding between documents routes live)
            loss = model(
                packed["tokens"], packed["position_ids"], None, labels=packed["labels"], packed_seq_params=params
            )
            (loss * tokens).sum().backward()
        torch.testing.assert_close(loss.detach()[0, tokens], expected, rtol=1e-5, atol=1e-6)
        for name, grad in router_grads(model).items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6)

        # replay_routes(model, Packed) checks the forward's PackedSeqParams against the packed routes' boundaries
        with torch.no_grad(), replay_routes(model, mine):
            replayed = model(packed["tokens"], packed["position_ids"], None, packed_seq_params=params)
        with torch.no_grad(), replay_routes(model, mine.routes):
            assert torch.equal(
                replayed, model(packed["tokens"], packed["position_ids"], None, packed_seq_params=params)
            )
        shifted = packed_params(cu, torch.tensor([0, 4, 16], dtype=torch.int32))
        for kwargs, why in (
            ({}, "without PackedSeqParams"),
            ({"packed_seq_params": shifted}, "cu_seqlens_q \\[0, 4, 16\\]"),
        ):
            with pytest.raises(ReplayError, match=why), torch.no_grad(), replay_routes(model, mine):
                model(packed["tokens"], packed["position_ids"], None, **kwargs)


def test_packed_row_with_attention_and_a_block_diagonal_mask_routes_as_the_batch():
    """With attention (megatron-core's local attention, learned absolute positions): the padded batch under its causal
    mask and the packed row [1, 16] under a block-diagonal causal mask with restarting positions route every token to
    the same experts, and the batch's routes packed (`to_packed`) and replayed on the row force them on perturbed
    routers, giving the batch's per-token losses. (True THD, with PackedSeqParams, needs Transformer Engine:
    scripts/megatron_cp_gpu.py.)"""
    seq = sequence_batch()
    packed, keep, cu, cu_padded = packed_batch()
    B, S = seq["tokens"].shape
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    padded_mask = (causal[None] | ~keep.bool()[:, None, :])[:, None]  # True = masked
    N = packed["tokens"].shape[1]
    doc = torch.repeat_interleave(torch.arange(len(cu_padded) - 1), (cu_padded[1:] - cu_padded[:-1]).long())
    block = (torch.ones(N, N, dtype=torch.bool).triu(1) | (doc[:, None] != doc[None, :]))[None, None]
    with megatron_cpu(port=free_port()):
        model = tiny_gpt(model_kwargs={"position_embedding_type": "learned_absolute"})
        with record_routes(model) as rec:
            model(seq["tokens"], seq["position_ids"], padded_mask)
        batch_routes = Routes(rec.routes.indices, rec.routes.mask & keep.bool(), rec.routes.layers)
        with record_routes(model) as rec:
            model(packed["tokens"], packed["position_ids"], block)
        mine = to_packed(batch_routes, keep, multiple=4)
        tokens = mine.routes.mask[0]
        same = (rec.routes.indices[0, tokens].sort(-1).values == mine.routes.indices[0, tokens].sort(-1).values).all()
        assert same, "the packed row routed some token elsewhere than the padded batch"
        perturb_routers(model)
        with torch.no_grad(), replay_routes(model, batch_routes):
            expected = model(seq["tokens"], seq["position_ids"], padded_mask, labels=seq["labels"])[keep.bool()]
        plain = Routes(mine.routes.indices, mine.routes.mask, mine.routes.layers)  # (no PackedSeqParams here)
        with torch.no_grad(), replay_routes(model, plain):
            got = model(packed["tokens"], packed["position_ids"], block, labels=packed["labels"])[0, tokens]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(ReplayError, match="without PackedSeqParams"), torch.no_grad():
            with replay_routes(model, mine.routes):  # (packed routes: megatron runs a packed row with PackedSeqParams)
                model(packed["tokens"], packed["position_ids"], block)
