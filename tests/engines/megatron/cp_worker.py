"""One gloo rank of the context-parallel tests (test_megatron_cp.py), and the batches and split references they share.

The model is the tests' tiny GPT without attention (`tiny_gpt(attention=False)`): megatron-core's local attention
asserts CP == 1 and its CP attention needs Transformer Engine, but embeddings, MoE layers (router, dispatcher,
experts), output layer, loss and aux loss run under CP on the CPU. Two batches: two whole sequences of 8 positions
(split per sequence by megatron-core's own `get_batch_on_this_cp_rank`), and the same two sequences cut to 5 and 7
tokens and packed into one THD row, each padded to a multiple of 2·CP (split per document by the reference below,
written from megatron-core's documentation of `thd_get_partitioned_indices`; megatron-core calls Transformer Engine
for it).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from megatron_utils import batch, megatron_cpu, perturb_routers, tiny_gpt

CP, LENGTHS, MULTIPLE = 2, (5, 7), 4
AUX = {"moe_aux_loss_coeff": 0.01}  # the aux loss on, reduced over the CP group as megatron-core reduces it
MODES = {  # mode: (ranks, megatron_cpu's sizes, TransformerConfig fields)
    "cp2": (2, {}, {}),
    "cp2_tp2": (4, {"tp": 2}, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
}


def reference_cp_split(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """megatron-core's per-sequence split of `x` along `dim` (a multiple of 2·CP long) for one CP rank."""
    chunks = x.unflatten(dim, (2 * cp_size, x.shape[dim] // (2 * cp_size)))
    return chunks.index_select(dim, torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])).flatten(dim, dim + 1)


def reference_thd_split(x: torch.Tensor, cu_padded: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """The per-document split of a packed row `x` [1, N, ...] as megatron-core documents it: every document (between
    consecutive `cu_padded`) cut into 2·CP chunks, rank r keeping chunks r and 2·CP − 1 − r, documents in order."""
    docs = [x[:, a:b] for a, b in zip(cu_padded[:-1], cu_padded[1:], strict=True)]
    return torch.cat([reference_cp_split(d, cp_size, cp_rank) for d in docs], dim=1)


def sequence_batch() -> dict[str, torch.Tensor]:
    """Two sequences of 8 tokens: tokens, position_ids and labels [2, 8]."""
    tokens, position_ids, _, labels = batch(b=2, s=8, seed=3)
    return {"tokens": tokens, "position_ids": position_ids, "labels": labels}


def packed_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two sequences cut to LENGTHS and right-padded ([2, 8] with an attention mask), and the same tokens packed
    in one row [1, 16], each padded to a multiple of 4, positions restarting: (packed batch, attention mask,
    cu_seqlens, cu_seqlens_padded)."""
    seq = sequence_batch()
    keep = torch.arange(8)[None] < torch.tensor(LENGTHS)[:, None]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    padded = [-(-n // MULTIPLE) * MULTIPLE for n in LENGTHS]
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    packed = {}
    for key, x in seq.items():
        row = torch.zeros(1, int(cu_padded[-1]), dtype=x.dtype)
        for i, n in enumerate(LENGTHS):
            row[0, cu_padded[i] : cu_padded[i] + n] = x[i, :n]
        packed[key] = row
    packed["position_ids"] = torch.cat([torch.arange(n) for n in padded])[None]
    return packed, keep.long(), cu, cu_padded


def packed_params(cu: torch.Tensor, cu_padded: torch.Tensor) -> Any:
    """megatron-core's PackedSeqParams of the packed row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu_padded[1:] - cu_padded[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def cp_batch(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of a batch of whole sequences, split by megatron-core's own get_batch_on_this_cp_rank (0.19
    added a leading `is_hybrid_cp`, and without `cp_group` splits over the whole world, not the CP group)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    data, group = dict(data), parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(data, False, cp_group=group)
    return get_batch_on_this_cp_rank(data, cp_group=group)


def refused(model: torch.nn.Module, routes: Any, run: Any) -> str:
    """The message of the ReplayError that replaying `routes` raises (before or as `run()` starts), or ''."""
    from moe_replay.engines.megatron import replay_routes
    from moe_replay.errors import ReplayError

    try:
        with replay_routes(model, routes):
            run()
    except ReplayError as e:
        return str(e)
    return ""


def cp_worker(rank: int, mode: str, out_dir: str, port: int) -> None:
    """On global rank `rank` (CP rank c): record both batches, replay its own parts, replay the single-process routes
    (split for CP rank c) with the routers perturbed, and try routes of the wrong place; save what it saw to
    out_dir/rank{rank}.pt."""
    from megatron.core import parallel_state

    from moe_replay import Routes
    from moe_replay.engines.megatron import record_routes, replay_routes
    from moe_replay.routes import to_cp

    torch.set_num_threads(1)
    out = Path(out_dir)
    world, sizes, overrides = MODES[mode]
    with megatron_cpu(rank=rank, world=world, port=port, cp=CP, **sizes):
        rank = parallel_state.get_context_parallel_rank()  # (from here on: the CP rank)
        model = tiny_gpt(attention=False, context_parallel_size=CP, **overrides, **AUX)
        local = cp_batch(sequence_batch())
        packed, _, cu, cu_padded = packed_batch()
        params = packed_params(cu, cu_padded)
        local_packed = {k: reference_thd_split(v, cu_padded.tolist(), CP, rank) for k, v in packed.items()}

        def run(labels: bool = False, thd: bool = False) -> torch.Tensor:
            data, extra = (local_packed, {"packed_seq_params": params}) if thd else (local, {})
            return model(data["tokens"], data["position_ids"], None, labels=data["labels"] if labels else None, **extra)

        seen: dict[str, Any] = {"router_input_len": []}
        model.decoder.layers[0].mlp.router.register_forward_hook(
            lambda m, args, output: seen["router_input_len"].append(args[0].shape[0])
        )
        for name, thd in (("seq", False), ("thd", True)):
            with record_routes(model) as rec:
                logits = run(thd=thd)
            with replay_routes(model, rec.routes):
                replayed = run(thd=thd)
            seen[f"{name}_part"] = rec.routes  # (a CPRoutes: this rank's part, knowing its place)
            seen[f"{name}_replay_exact"] = torch.equal(logits, replayed)
        whole = Routes.load(out / "seq_reference.safetensors")
        whole_packed = Routes.load(out / "thd_reference.safetensors")
        seen["refused"] = {  # the wrong place, found before any router runs
            "other rank": refused(model, to_cp(whole, CP, 1 - rank), run),
            "whole batch": refused(model, whole, run),
            "per-sequence part, packed forward": refused(model, to_cp(whole, CP, rank), lambda: run(thd=True)),
            "packed part, per-sequence forward": refused(
                model, to_cp(whole_packed, CP, rank, cu_seqlens_padded=cu_padded), run
            ),
        }
        perturb_routers(model)  # live routing now moves: replay has to force the single-process routes
        for name, thd, routes in (
            ("seq", False, to_cp(whole, CP, rank)),
            ("thd", True, to_cp(whole_packed, CP, rank, cu_seqlens_padded=cu_padded)),
        ):
            with record_routes(model) as live:
                run(thd=thd)
            model.zero_grad()
            with replay_routes(model, routes, track_live=True) as ctx:
                loss = run(labels=True, thd=thd)
                loss.sum().backward()
            seen[f"{name}_live"] = live.routes.indices
            seen[f"{name}_loss"] = loss.detach()
            seen[f"{name}_moved"] = ctx.live_moved()
            seen[f"{name}_grads"] = {
                n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("router.weight")
            }
        seen["cp_rank"] = rank
        torch.save(seen, out / f"rank{torch.distributed.get_rank()}.pt")
