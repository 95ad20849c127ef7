"""Pipeline parallelism on two gloo ranks with megatron-core's own schedules (1F1B with 2 and 4 micro-batches, and
the interleaved schedule with 2 virtual-pipeline chunks per rank), against one process running the unsplit model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

from helpers import free_port  # noqa: E402
from megatron_utils import megatron_cpu, perturb_routers, tiny_gpt  # noqa: E402
from pipeline_worker import PATTERN, micro_batches, pipeline_worker  # noqa: E402

from moe_replay.engines.megatron import record_routes, replay_routes  # noqa: E402

COUNTS = (2, 4)
# the MoE layers each rank holds: stages of two layers (1F1B), or one layer per chunk, chunks dealt round-robin
STAGE_LAYERS = {None: ([0, 1], [3]), 2: ([0], [1, 3])}


@pytest.fixture(scope="module")
def reference():
    """Per micro-batch count: the unsplit model's routes, then, with perturbed routers replaying them, the per-token
    losses and the gradients of the schedule's loss (the mean of the micro-batches' mean token losses)."""
    found = {}
    with megatron_cpu(port=free_port()):
        for n in COUNTS:
            model = tiny_gpt(num_layers=len(PATTERN), moe_layer_freq=PATTERN)
            data = micro_batches(n)
            routes = []
            for tokens, pos, mask, _ in data:
                with torch.no_grad(), record_routes(model) as rec:
                    model(tokens, pos, mask)
                routes.append(rec.routes)
            perturb_routers(model)
            with replay_routes(model, routes):
                losses = [model(tokens, pos, mask, labels=labels) for tokens, pos, mask, labels in data]
                (sum(loss.mean() for loss in losses) / n).backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            found[n] = (routes, [loss.detach() for loss in losses], grads)
    return found


RUNS = [(None, COUNTS), (2, (4,))]  # 1F1B with 2 and 4 micro-batches; interleaved, 2 chunks per rank, 4


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """What the two pipeline ranks saved (one spawn for every layout: starting ranks costs more than running them)."""
    out = tmp_path_factory.mktemp("megatron_pipeline")
    torch.multiprocessing.spawn(pipeline_worker, args=(RUNS, str(out), free_port()), nprocs=2, join=True)
    return out


@pytest.mark.parametrize("vpp,counts", RUNS, ids=["1f1b", "interleaved"])
def test_pipeline_stages_record_gather_and_replay_like_one_process(reference, pipeline_runs, vpp, counts):
    for n in counts:
        routes, losses, grads = reference[n]
        seen = [torch.load(pipeline_runs / f"{vpp}_{rank}_{n}.pt") for rank in (0, 1)]
        for rank, got in enumerate(seen):
            # each stage records only its layers, named by their global number; gathered, they are the whole model's
            assert got["own_layers"] == [f"decoder.layers.{i}.mlp.router" for i in STAGE_LAYERS[vpp][rank]]
            assert got["whole_layers"] == [layer.name for layer in routes[0].layers]
            for mb in range(n):
                assert torch.equal(got["whole"][mb], routes[mb].indices), f"rank {rank}, micro-batch {mb}"
            # gradients of the replayed training pass (full recompute on both stages) equal the unsplit model's
            assert got["recomputed"] == n * len(STAGE_LAYERS[vpp][rank]), f"rank {rank}: recompute did not run"
            assert got["grads"], f"rank {rank} got no gradients"
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")
            assert any(name.endswith("mlp.router.weight") and g.abs().sum() > 0 for name, g in got["grads"].items())
            # track_live: each stage compares its own layers' calls only, recomputes not counted
            moved, compared = got["live_counts"]
            own = [[0, 1, 3].index(i) for i in STAGE_LAYERS[vpp][rank]]  # its columns of the whole model's routes
            assert compared == [got["tokens"] if c in own else 0 for c in range(3)], f"rank {rank}"
            assert all(moved[c] == 0 for c in range(3) if c not in own)
            if rank == 0:  # the first MoE layer sees the same input live and replayed: exactly the live difference
                assert moved[0] == got["moved_first"]
        last = seen[1]
        assert any(got["live_moved"] for got in seen), "perturbing the routers moved no expert: replay untested"
        for mb in range(n):
            torch.testing.assert_close(last["losses"][mb], losses[mb], rtol=1e-5, atol=1e-6)
        if n == max(counts):  # the stage's own part, and the routes under another engine's names (by layer order)
            for mb in range(n):
                assert torch.equal(last["losses_own"][mb], last["losses"][mb])
                assert torch.equal(last["losses_foreign"][mb], last["losses"][mb])
            for got in seen:
                for name, grad in got["grads_own"].items():
                    torch.testing.assert_close(grad, got["grads"][name], rtol=1e-6, atol=1e-8)
