"""Two gloo ranks on CPU: generate with synced_gpus (what FSDP and ZeRO-3 generation need), DDP and FSDP2
(`fully_shard`), with and without torch activation checkpointing."""

from __future__ import annotations

import pytest
import torch
from dist_worker import worker
from helpers import free_port, same_but_near_ties


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_distributed")
    torch.multiprocessing.spawn(worker, args=(str(out), free_port()), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_synced_gpus_dummy_forwards_are_not_recorded(ranks):
    """Rank 0 finishes first and runs dummy forwards until rank 1 is done; its routes still span exactly its own
    out.sequences (on today's main `rec.routes` raised a size mismatch), and match a teacher-forced forward's expert
    sets but at its near-ties (`helpers.near_ties`, and what follows one that came out otherwise:
    `helpers.same_but_near_ties`)."""
    r0, r1 = (rank["synced"] for rank in ranks)
    assert r0["sequences"].shape[1] < r1["sequences"].shape[1]  # rank 0 really finished early
    assert r0["forwards"] > r0["sequences"].shape[1] - 5  # ... and kept running forwards past its last token
    for seen in (r0, r1):
        routes, tf, seq = seen["routes"], seen["teacher_forced"], seen["sequences"]
        assert routes.seq_len == seq.shape[1] and not routes.mask[:, -1].any()
        same_but_near_ties(routes, tf, seen["near_ties"])
        assert torch.equal(seen["replayed_sequences"], seq) and seen["replayed_routes"].equal(routes)


@pytest.mark.parametrize("shard", ["ddp", "fsdp2"])
def test_data_parallel_replay_gives_the_expected_gradients(ranks, shard):
    for rank in ranks:
        seen = rank[shard]
        for a, b in zip(seen["own"], seen["plain"], strict=True):  # replaying its own routes: the plain gradients
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert not seen["live_after_perturb"].equal(seen["routes"])  # after the perturbation live routing moved
        for a, b in zip(seen["checkpointed"], seen["replayed"], strict=True):  # checkpointing recomputes the replay
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        gen = seen["generate_routes"]
        assert gen.seq_len == seen["generated"].shape[1]  # recorded under generate through the wrapper
    assert not ranks[0][shard]["routes"].equal(ranks[1][shard]["routes"])  # each rank routed its own data
