"""Context parallelism (CP = 2) on two gloo ranks against one process running the same weights at CP = 1, for a
batch of whole sequences (split per sequence by megatron-core's get_batch_on_this_cp_rank) and a packed THD row
(split per document): each rank's recording is its part of the single-process routes, the parts join into them,
and a replay of the single-process routes split for each rank forces them on perturbed routers, giving the
single-process per-token losses, summed router gradients (aux loss included) and live-pick counts (cp_worker.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

from cp_worker import (  # noqa: E402
    AUX,
    CP,
    MODES,
    cp_worker,
    packed_batch,
    packed_params,
    reference_cp_split,
    reference_thd_split,
    sequence_batch,
)
from helpers import free_port  # noqa: E402
from megatron_utils import megatron_cpu, perturb_routers, tiny_gpt  # noqa: E402

from moe_replay.engines.megatron import record_routes, replay_routes  # noqa: E402
from moe_replay.routes import CPRoutes, from_cp  # noqa: E402


@pytest.fixture(scope="module", params=list(MODES))
def ranks(request, tmp_path_factory):
    """The single-process references (routes; with perturbed routers replaying them: per-token losses, router
    gradients, live-pick counts) and what each rank saw, CP 2 alone and CP 2 × TP 2 with sequence parallelism (the
    router input a quarter of each sequence): per CP rank, the first of its ranks, and all ranks."""
    out = tmp_path_factory.mktemp("megatron_cp")
    seq = sequence_batch()
    packed, _, cu, cu_padded = packed_batch()
    params = packed_params(cu, cu_padded)
    inputs = {
        "seq": (seq, {}),
        "thd": (packed, {"packed_seq_params": params}),
    }
    reference = {}
    with megatron_cpu(port=free_port()):
        model = tiny_gpt(attention=False, **AUX)
        for name, (data, extra) in inputs.items():
            with record_routes(model) as rec:
                model(data["tokens"], data["position_ids"], None, **extra)
            rec.routes.save(out / f"{name}_reference.safetensors")
            reference[name] = {"routes": rec.routes}
        perturb_routers(model)
        for name, (data, extra) in inputs.items():
            model.zero_grad()
            with replay_routes(model, reference[name]["routes"], track_live=True) as ctx:
                loss = model(data["tokens"], data["position_ids"], None, labels=data["labels"], **extra)
                loss.sum().backward()
            reference[name].update(
                loss=loss.detach(),
                moved=ctx.live_moved(),
                grads={n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("router.weight")},
            )
    world = MODES[request.param][0]
    torch.multiprocessing.spawn(cp_worker, args=(request.param, str(out), free_port()), nprocs=world, join=True)
    every = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    seen = [next(s for s in every if s["cp_rank"] == c) for c in range(CP)]
    return reference, seen, cu_padded.tolist(), every


def split(x: torch.Tensor, name: str, rank: int, cu_padded: list[int]) -> torch.Tensor:
    return reference_cp_split(x, CP, rank) if name == "seq" else reference_thd_split(x, cu_padded, CP, rank)


@pytest.mark.parametrize("name", ["seq", "thd"])
def test_cp_ranks_record_their_part_and_replay_the_single_process_routes(ranks, name):
    reference, seen, cu_padded, every = ranks
    whole = reference[name]["routes"]
    tp = len(every) // CP
    parts = [s[f"{name}_part"] for s in seen]
    for rank, (part, s) in enumerate(zip(parts, seen, strict=True)):
        # the split really happened: half of each sequence per router call, recorded as this rank's place
        assert s["router_input_len"][0 if name == "seq" else 2] == whole.seq_len // CP // tp
        assert isinstance(part, CPRoutes) and (part.cp_size, part.cp_rank) == (CP, rank)
        assert part.cu_seqlens_padded == (None if name == "seq" else tuple(cu_padded))
        assert torch.equal(part.indices, split(whole.indices, name, rank, cu_padded)), f"rank {rank}"
        assert s[f"{name}_replay_exact"], f"rank {rank}: replaying its own part changed the logits"
    assert from_cp(parts).equal(whole)  # the parts join into exactly the CP = 1 recording
    # perturbed routers route elsewhere live; replay forces the single-process routes on every rank
    assert any(not torch.equal(s[f"{name}_live"], split(whole.indices, name, r, cu_padded)) for r, s in enumerate(seen))
    for s in every:  # (the tensor-parallel ranks of a CP rank hold its whole part: the recorder gathers the slices)
        assert torch.equal(s[f"{name}_part"].indices, seen[s["cp_rank"]][f"{name}_part"].indices)
        expected = split(reference[name]["loss"], name, s["cp_rank"], cu_padded)
        torch.testing.assert_close(s[f"{name}_loss"], expected, rtol=1e-5, atol=1e-6)
    for param, grad in reference[name]["grads"].items():  # summed over the ranks, as megatron's DDP reduces them
        torch.testing.assert_close(sum(s[f"{name}_grads"][param] for s in every), grad, rtol=1e-5, atol=1e-6)
        assert grad.abs().sum() > 0
    moved = [sum(s[f"{name}_moved"][i] for s in every) for i in range(2)]  # (each TP rank counts its own slice)
    assert all(torch.equal(a, b) for a, b in zip(moved, reference[name]["moved"], strict=True))
    assert int(moved[0].sum()) > 0  # (the perturbation moved live picks, so the counts are not trivially zero)


def test_cp_ranks_refuse_routes_of_the_wrong_place(ranks):
    _, _, _, every = ranks
    for s in every:
        rank = s["cp_rank"]
        got = s["refused"]
        assert f"are CP rank {1 - rank} of 2 (per-sequence layout) but this is CP rank {rank} of 2" in got["other rank"]
        assert f"not a CP part: pass moe_replay.routes.to_cp(routes, cp_size=2, cp_rank={rank})" in got["whole batch"]
        assert (
            "got a packed row of documents [0, 8, 16] but its routes were split for whole sequences"
            in got["per-sequence part, packed forward"]
        )
        assert (
            "got whole sequences (per-sequence layout) but its routes were split for a packed row"
            in got["packed part, per-sequence forward"]
        )
