"""What each of two gloo ranks runs for test_distributed.py: generation with synced_gpus, DDP and FSDP2, with and
without torch activation checkpointing. Results go to out_dir/rank{r}.pt for the test to check."""

from __future__ import annotations

import copy
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import PAD, extend_mask, left_padded, near_ties, perturb, sampled, tiny_qwen3_moe
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

from moe_replay import record_routes, replay_routes

EOS = 7


def torch_checkpointing(model: torch.nn.Module) -> None:
    wrap = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, Qwen3MoeDecoderLayer)
    )


def grads(model: torch.nn.Module, ids: torch.Tensor, routes=None) -> list[torch.Tensor]:  # noqa: ANN001
    """Local gradients (FSDP2: this rank's shards) of one forward + backward, replaying `routes` if given."""
    model.zero_grad(set_to_none=True)
    ctx = replay_routes(model, routes) if routes is not None else torch.enable_grad()
    with ctx:
        model(ids, labels=ids, use_cache=False).loss.backward()
    return [getattr(p.grad, "to_local", lambda g=p.grad: g)().clone() for p in model.parameters()]


def synced_generation(rank: int) -> dict:
    """Rank 0's rows end early (EOS made likely) and keep running dummy forwards while rank 1 generates on."""
    model = tiny_qwen3_moe()
    with torch.no_grad():
        model.lm_head.weight[EOS] += 3.0 if rank == 0 else -3.0
    ids, mask = left_padded(2, 5, [1, 0], seed=rank)
    forwards = []
    model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    torch.manual_seed(rank)
    out, routes = sampled(model, ids, mask, 6, exact=False, eos_token_id=EOS, synced_gpus=True)
    seq, n_forwards = out.sequences, len(forwards)
    with record_routes(model) as tf:
        logits = model(seq, attention_mask=extend_mask(mask, seq.shape[1]), output_router_logits=True).router_logits
    torch.manual_seed(rank)
    with replay_routes(model, routes):  # dummy forwards are not replayed either
        replayed, again = sampled(model, ids, mask, 6, exact=False, eos_token_id=EOS, synced_gpus=True)
    return {
        "sequences": seq,
        "routes": routes,
        "teacher_forced": tf.routes,
        "near_ties": near_ties(logits, routes.top_k, seq.shape),
        "forwards": n_forwards,
        "replayed_sequences": replayed.sequences,
        "replayed_routes": again,
    }


def data_parallel(rank: int, shard: str) -> dict:
    """DDP or FSDP2: replaying a model's own routes gives the plain run's gradients; after a perturbation, replay
    under torch activation checkpointing gives the gradients of replay without it."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def wrap(model: torch.nn.Module, checkpointing: bool) -> torch.nn.Module:
        model = copy.deepcopy(model).train()
        if checkpointing:
            torch_checkpointing(model)
        if shard == "ddp":
            return DistributedDataParallel(model)
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)

    base = tiny_qwen3_moe()  # the same weights on both ranks
    ids, mask = left_padded(2, 6, [0, 0], seed=10 + rank)  # each rank its own data
    model = wrap(base, checkpointing=False)
    with torch.no_grad(), record_routes(model) as rec:
        model(ids, use_cache=False)
    plain = grads(model, ids)
    own = grads(model, ids, rec.routes)
    lm = getattr(model, "module", model)  # DDP has no generate: call its module's, recording on the wrapper
    with torch.no_grad(), record_routes(model) as gen:
        out = lm.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=3, pad_token_id=PAD)
    perturb(base)
    moved = wrap(base, checkpointing=False)
    with torch.no_grad(), record_routes(moved) as live:
        moved(ids, use_cache=False)
    replayed = grads(moved, ids, rec.routes)
    checkpointed = grads(wrap(base, checkpointing=True), ids, rec.routes)
    return {
        "plain": plain,
        "own": own,
        "replayed": replayed,
        "checkpointed": checkpointed,
        "routes": rec.routes,
        "live_after_perturb": live.routes,
        "generated": out,
        "generate_routes": gen.routes,
    }


def worker(rank: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        found = {"synced": synced_generation(rank)}
        for shard in ("ddp", "fsdp2"):
            found[shard] = data_parallel(rank, shard)
        torch.save(found, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
