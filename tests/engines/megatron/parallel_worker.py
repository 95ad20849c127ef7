"""One gloo rank of the parallel record/replay tests (test_megatron_parallel.py), by mode:

- "ep": expert parallel 2 (two ranks, rank r on batch seed r);
- "tp": tensor parallel 2 with sequence parallelism (two ranks, both on batch seed 0);
- "ep_tp_alltoall": expert parallel 2 × tensor parallel 2 with sequence parallelism on four ranks, the alltoall token
  dispatcher, experts not tensor-split (expert tensor parallel 1);
- "ep_tp_allgather": the same with the allgather dispatcher and the experts tensor-split too (expert tensor parallel 2).

In the four-rank modes the two tensor-parallel ranks of data-parallel rank d run batch seed d.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron_utils import batch, megatron_cpu, perturb_routers, tiny_gpt

MODES = {  # mode: (ranks, megatron_cpu's sizes, TransformerConfig fields)
    "ep": (2, {"ep": 2}, {"expert_model_parallel_size": 2}),
    "tp": (2, {"tp": 2}, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "ep_tp_alltoall": (
        4,
        {"tp": 2, "ep": 2, "etp": 1},
        {
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
            "moe_token_dispatcher_type": "alltoall",
        },
    ),
    "ep_tp_allgather": (
        4,
        {"tp": 2, "ep": 2, "etp": 2},
        {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2},
    ),
}


def parallel_worker(rank: int, mode: str, out_dir: str, port: int) -> None:
    """Record, replay its own routes, replay the routes of the single-process reference (of its batch seed), and save
    what it saw to out_dir/rank{r}.pt for the test to compare."""
    from megatron.core import parallel_state

    from moe_replay import Routes
    from moe_replay.engines.megatron import record_routes, replay_routes

    torch.set_num_threads(1)
    out = Path(out_dir)
    world, sizes, overrides = MODES[mode]
    with megatron_cpu(rank=rank, world=world, port=port, **sizes):
        seed = parallel_state.get_data_parallel_rank()
        model = tiny_gpt(**overrides)
        tokens, pos, mask, labels = batch(b=3, s=8, seed=seed)
        router = model.decoder.layers[0].mlp.router
        seen_len: list[int] = []
        router.register_forward_hook(lambda m, args, out: seen_len.append(args[0].shape[0]))
        with record_routes(model) as rec:
            logits = model(tokens, pos, mask)
        with replay_routes(model, rec.routes):
            replayed = model(tokens, pos, mask)
        loss = model(tokens, pos, mask, labels=labels)
        reference = Routes.load(out / f"reference_seed{seed}.safetensors")
        with replay_routes(model, reference):
            loss_ref_routes = model(tokens, pos, mask, labels=labels)
            loss_ref_routes.mean().backward()
        perturb_routers(model)  # now live routing moves: replay has to force the reference routes
        with record_routes(model) as live:
            model(tokens, pos, mask)
        with replay_routes(model, reference):
            loss_perturbed = model(tokens, pos, mask, labels=labels).detach()
        torch.save(
            {
                "seed": seed,
                "routes": rec.routes.indices,
                "replay_exact": torch.equal(logits, replayed),
                "loss": loss.detach(),
                "loss_reference_routes": loss_ref_routes.detach(),
                "live_routes_perturbed": live.routes.indices,
                "loss_perturbed_replay": loss_perturbed,
                "router_input_len": seen_len[0],
                "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
                "dispatcher": type(model.decoder.layers[0].mlp.token_dispatcher).__name__,
                "router_grads": [
                    r.weight.grad.abs().sum().item() for n, r in model.named_modules() if n.endswith("router")
                ],
            },
            out / f"rank{rank}.pt",
        )
