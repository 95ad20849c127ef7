"""record_routes / replay_routes on gloo ranks against a single-process run of the same weights: expert parallel 2
and tensor parallel 2 with sequence parallelism on two ranks, and both at once on four ranks with the alltoall and the
allgather token dispatchers (parallel_worker.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

from helpers import free_port  # noqa: E402
from megatron_utils import batch, megatron_cpu, perturb_routers, tiny_gpt  # noqa: E402
from parallel_worker import MODES, parallel_worker  # noqa: E402

from moe_replay.engines.megatron import record_routes, replay_routes  # noqa: E402


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Routes and per-token losses of the unsplit model on batch seeds 0 and 1, from one process, and the loss of
    the same model with perturbed routers replaying those routes."""
    out = tmp_path_factory.mktemp("megatron_parallel")
    found = {}
    with megatron_cpu(port=free_port()):
        for seed in (0, 1):
            model = tiny_gpt()
            tokens, pos, mask, labels = batch(b=3, s=8, seed=seed)
            with record_routes(model) as rec:
                model(tokens, pos, mask)
            rec.routes.save(out / f"reference_seed{seed}.safetensors")
            loss = model(tokens, pos, mask, labels=labels).detach()
            perturb_routers(model)
            with replay_routes(model, rec.routes):
                perturbed = model(tokens, pos, mask, labels=labels).detach()
            found[seed] = (rec.routes.indices, loss, perturbed)
    return out, found


# (router input length per call, local experts, token dispatcher, batch seed of rank r)
EXPECTED = {
    "ep": (8, 2, "MoEAllGatherTokenDispatcher", lambda rank: rank),
    "tp": (4, 4, "MoEAllGatherTokenDispatcher", lambda rank: 0),
    "ep_tp_alltoall": (4, 2, "MoEAlltoAllTokenDispatcher", lambda rank: rank // 2),
    "ep_tp_allgather": (4, 2, "MoEAllGatherTokenDispatcher", lambda rank: rank // 2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_ranks_replay_exactly_and_match_one_process(references, mode):
    out, found = references
    ranks = MODES[mode][0]
    torch.multiprocessing.spawn(parallel_worker, args=(mode, str(out), free_port()), nprocs=ranks, join=True)
    length, local, dispatcher, seed_of = EXPECTED[mode]
    for rank in range(ranks):
        seen = torch.load(out / f"rank{rank}.pt")
        assert seen["seed"] == seed_of(rank)
        routes, loss, perturbed = found[seen["seed"]]
        # the split really happened: half the sequence per router call (sequence parallel), half the experts per
        # rank (expert parallel), through the dispatcher asked for
        assert (seen["router_input_len"], seen["local_experts"], seen["dispatcher"]) == (length, local, dispatcher)
        assert seen["replay_exact"], f"rank {rank}: replaying its own routes changed the logits"
        # under sequence parallelism each rank routes half the sequence; the recorder gathers the whole batch
        assert torch.equal(seen["routes"], routes), f"rank {rank}: routes differ from the single-process run"
        torch.testing.assert_close(seen["loss"], loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(seen["loss_reference_routes"], loss, rtol=1e-5, atol=1e-6)
        assert all(g > 0 for g in seen["router_grads"])
        # after perturbing the routers, live routing moves, and replay forces the single-process routes
        assert not torch.equal(seen["live_routes_perturbed"], routes)
        torch.testing.assert_close(seen["loss_perturbed_replay"], perturbed, rtol=1e-5, atol=1e-6)
