"""The pipeline-parallel side of test_megatron_pipeline.py: a 4-layer GPTModel (MoE layers 0, 1, 3; layer 2 dense)
split over 2 gloo ranks, run through megatron-core's own schedules (`get_forward_backward_func()`): 1F1B, or the
interleaved schedule with 2 virtual-pipeline chunks per rank. Each rank records, gathers, replays and saves what it
saw for the test to compare with the single-process run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron_utils import batch, global_name, megatron_cpu, perturb_routers, tiny_gpt

PATTERN = [1, 1, 0, 1]  # MoE, MoE, dense, MoE: global MoE index != layer number on the second stage
MOE_LAYERS = [i for i, moe in enumerate(PATTERN) if moe]  # their decoder-layer numbers
PIPELINE = {
    "num_layers": len(PATTERN),
    "moe_layer_freq": PATTERN,
    "pipeline_model_parallel_size": 2,
    "pipeline_dtype": torch.float32,
    "batch_p2p_comm": False,  # the batched p2p path calls torch.cuda.synchronize()
}
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def micro_batches(n: int) -> list[tuple[torch.Tensor, ...]]:
    """n micro-batches of 2 sequences of 8 tokens (tokens, position ids, mask, labels), the same on every rank."""
    return [batch(b=2, s=8, seed=10 + i) for i in range(n)]


def stage_chunks(vpp: int | None) -> list[torch.nn.Module]:
    """This rank's model chunks: one stage model (1F1B) or `vpp` virtual-pipeline chunks."""
    from megatron.core import parallel_state as ps

    chunks = []
    for vp in range(vpp or 1):
        stage = {"vp_stage": vp} if vpp else {}
        first = ps.is_pipeline_first_stage(ignore_virtual=vpp is None, **stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=vpp is None, **stage)
        extra = {"virtual_pipeline_model_parallel_size": vpp} if vpp else {}
        kwargs = {"pre_process": first, "post_process": last, **stage}
        chunks.append(tiny_gpt(**PIPELINE, **extra, model_kwargs=kwargs))
    return chunks


def run_schedule(chunks: list[torch.nn.Module], data: list, forward_only: bool) -> list[torch.Tensor]:
    """One pass of megatron's schedule over `data`; the last stage returns each micro-batch's per-token losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        tokens, pos, mask, labels = next(iterator)
        out = model(tokens, pos, mask, labels=labels)

        def loss_func(losses: torch.Tensor) -> tuple[torch.Tensor, dict]:
            return losses.float().mean(), {"tokens": losses.detach()}

        return out, loss_func

    iterators = [iter(data) for _ in chunks]
    found = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks,
        num_microbatches=len(data),
        seq_length=data[0][0].shape[1],
        micro_batch_size=data[0][0].shape[0],
        forward_only=forward_only,
    )
    return [f["tokens"] for f in found]


def grads(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by its global name; gradients are cleared."""
    out = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.grad is not None:
                out[global_name(chunk, name)] = p.grad.clone()
                p.grad = None
    return out


def set_recompute(chunks: list[torch.nn.Module], on: bool) -> None:
    for chunk in chunks:
        for key, value in FULL_RECOMPUTE.items():
            setattr(chunk.config, key, value if on else None)


def pipeline_worker(rank: int, runs: list[tuple[int | None, tuple[int, ...]]], out_dir: str, port: int) -> None:
    """One of two pipeline ranks. For each (virtual-pipeline size, micro-batch counts) in `runs` and each count:
    record through the schedule (forward only) and gather the stages' routes; perturb the routers; replay the whole
    model's routes in a training pass with full recompute (and, for the largest count, the stage's own part and the
    routes renamed as another engine's, without); save routes, losses and gradients to
    out_dir/{vpp}_{rank}_{n}.pt."""
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    with megatron_cpu(rank=rank, world=2, port=port, pp=2):
        for vpp, counts in runs:
            ps.destroy_model_parallel()  # one process group, each run its own pipeline layout
            ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp)
            run_counts(rank, vpp, counts, out_dir)


def moved_slots(a: Any, b: Any, layer: int) -> int:
    """Expert slots of `layer` (a column of both Routes) in `a` not among `b`'s at the same position."""
    x, y = a.indices[:, :, layer].long(), b.indices[:, :, layer].long()
    return int((x.shape[-1] - (x[..., :, None] == y[..., None, :]).any(-1).sum(-1)).sum())


def run_counts(rank: int, vpp: int | None, counts: tuple[int, ...], out_dir: str) -> None:
    """`pipeline_worker`'s work for one pipeline layout."""
    from moe_replay import LayerInfo, Routes
    from moe_replay.engines.autograd import in_backward
    from moe_replay.engines.megatron import gather_pipeline_routes, record_routes, replay_routes

    for n in counts:
        chunks = stage_chunks(vpp)
        data = micro_batches(n)
        with record_routes(chunks) as rec:
            run_schedule(chunks, data, forward_only=True)
        own = rec.batches
        whole = [gather_pipeline_routes(r, chunks) for r in own]
        for chunk in chunks:
            perturb_routers(chunk)
        with record_routes(chunks) as live:
            run_schedule(chunks, data, forward_only=True)
        set_recompute(chunks, True)
        recomputed = []  # router calls inside the backward: the recompute really ran
        hooks = [
            m.register_forward_hook(lambda *_, seen=recomputed: seen.append(in_backward()))
            for chunk in chunks
            for name, m in chunk.named_modules()
            if name.endswith("mlp.router")
        ]
        with replay_routes(chunks, whole, track_live=True) as ctx:
            losses = run_schedule(chunks, data, forward_only=False)
        for hook in hooks:
            hook.remove()
        found: dict[str, Any] = {
            "own_layers": [layer.name for layer in own[0].layers],
            "whole": [w.indices for w in whole],
            "whole_layers": [layer.name for layer in whole[0].layers],
            "live_moved": any(not torch.equal(a.indices, b.indices) for a, b in zip(live.batches, own, strict=True)),
            "losses": losses,
            "recomputed": sum(recomputed),
            "grads": grads(chunks),
            "live_counts": [t.tolist() for t in ctx.live_moved()],  # (moved, compared) per whole-model column
            "tokens": sum(int(r.mask.sum()) for r in own),
            "moved_first": sum(moved_slots(a, b, 0) for a, b in zip(own, live.batches, strict=True)),
        }
        set_recompute(chunks, False)
        if n == max(counts):
            with replay_routes(chunks, own):
                found["losses_own"] = run_schedule(chunks, data, forward_only=False)
            found["grads_own"] = grads(chunks)
            foreign = [  # the same routes named as a Hugging Face model names its routers: matched by layer order
                Routes(w.indices, w.mask, [LayerInfo(f"model.layers.{i}.mlp.gate", 4, 2) for i in MOE_LAYERS])
                for w in whole
            ]
            with replay_routes(chunks, foreign):
                found["losses_foreign"] = run_schedule(chunks, data, forward_only=True)
        torch.save(found, Path(out_dir) / f"{vpp}_{rank}_{n}.pt")
