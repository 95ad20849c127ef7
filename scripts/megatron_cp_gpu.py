"""GPU checks of context parallelism and packed (THD) sequences on megatron-core with Transformer Engine: what the CPU
tests (tests/engines/megatron/test_megatron_cp.py, test_megatron_packed.py) cannot run, because megatron-core's CP
attention and its THD attention need Transformer Engine and CUDA. Written for a lent device; not yet run on one.

    python scripts/megatron_cp_gpu.py --out OUT            # 1 GPU: TE's THD split against ours; a full GPT (TE
                                                           # attention) packed vs padded; writes OUT/reference.pt
    torchrun --nproc-per-node 2 scripts/megatron_cp_gpu.py --out OUT   # 2+ GPUs: the same GPT under CP (per sequence
                                                           # and per document) against OUT/reference.pt

Each check prints one line `check | result | detail` and the run ends with `checks passed: N/M`.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import torch

LENGTHS, T, MULTIPLE = (37, 64, 20), 64, 8  # three sequences of a [3, 64] batch; documents padded to multiples of 8


def report(results: list[bool], name: str, ok: bool, detail: str = "") -> None:
    results.append(bool(ok))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{name} | {'ok' if ok else 'FAILED'} | {detail}", flush=True)


def te_split(results: list[bool]) -> None:
    """Transformer Engine's thd_get_partitioned_indices against thd_cp_positions."""
    import transformer_engine_torch as tex

    from moe_replay.routes import thd_cp_positions

    for cp in (1, 2, 4):
        for docs in ((8,), (16, 8, 24), (64, 8, 8, 32)):
            cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            for rank in range(cp):
                if any(n % (2 * cp) for n in docs):
                    continue
                theirs = tex.thd_get_partitioned_indices(cu, int(cu[-1]), cp, rank).long().cpu()
                ours = thd_cp_positions(cu.cpu(), cp, rank)
                report(results, f"TE THD split cp={cp} rank={rank} docs={docs}", torch.equal(theirs, ours))


def build(cp: int) -> torch.nn.Module:
    """A 2-layer GPT with TE layers, 8 experts top-2, bf16, routing replay on, seed 0."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512, num_moe_experts=8,
        moe_router_topk=2, moe_ffn_hidden_size=256, moe_token_dispatcher_type="alltoall",
        moe_enable_routing_replay=True, context_parallel_size=cp, bf16=True, params_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, moe_aux_loss_coeff=0.01,
    )  # fmt: skip
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=False)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=1024, max_sequence_length=T).cuda()


def data() -> dict[str, object]:
    """The padded batch, its attention mask and the same tokens packed (with PackedSeqParams)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1024, (len(LENGTHS), T), generator=g)
    keep = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    padded = [-(-n // MULTIPLE) * MULTIPLE for n in LENGTHS]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    row = torch.zeros(1, int(cu_padded[-1]), dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        row[0, cu_padded[i] : cu_padded[i] + n] = tokens[i, :n]
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu.cuda(), cu_seqlens_kv=cu.cuda(), cu_seqlens_q_padded=cu_padded.cuda(),
        cu_seqlens_kv_padded=cu_padded.cuda(), max_seqlen_q=max(padded), max_seqlen_kv=max(padded),
    )  # fmt: skip
    causal = torch.ones(len(LENGTHS), 1, T, T, dtype=torch.bool).triu(1)
    return {
        "tokens": tokens.cuda(), "position_ids": torch.arange(T).expand(len(LENGTHS), T).cuda(),
        "mask": (causal | ~keep[:, None, None, :]).cuda(), "keep": keep, "row": row.cuda(),
        "row_positions": torch.cat([torch.arange(n) for n in padded])[None].cuda(), "params": params,
        "cu_padded": cu_padded,
    }  # fmt: skip


def forced(model: torch.nn.Module, run: object, routes: object) -> float:
    """The share of replayed (recorded) token-layer entries whose routing map holds exactly the replayed experts."""
    from moe_replay.engines.megatron import replay_routes

    maps = []
    hooks = [m.register_forward_hook(lambda m, a, out: maps.append(out[1].detach()))
             for n, m in model.named_modules() if n.endswith("mlp.router")]  # fmt: skip
    with torch.no_grad(), replay_routes(model, routes):
        run()
    for h in hooks:
        h.remove()
    S, B = routes.seq_len, routes.batch_size
    hits = total = 0
    for layer, routing_map in enumerate(maps):  # [S * B, E], sequence-major
        chosen = routing_map.view(S, B, -1).transpose(0, 1)[routes.mask.cuda()]
        want = torch.zeros_like(chosen).scatter_(1, routes.indices[..., layer, :][routes.mask].long().cuda(), True)
        hits, total = hits + int((chosen == want).all(1).sum()), total + chosen.shape[0]
    return hits / max(total, 1)


def one_gpu(results: list[bool], out: Path) -> None:
    """CP = 1: packed vs padded with TE attention; the reference for the CP run."""
    from moe_replay import Routes, to_packed
    from moe_replay.engines.megatron import record_routes

    d, model = data(), build(1)
    with torch.no_grad(), record_routes(model) as rec:
        model(d["tokens"], d["position_ids"], d["mask"])
    padded = rec.routes.to("cpu")
    padded = Routes(padded.indices, padded.mask & d["keep"], padded.layers)
    with torch.no_grad(), record_routes(model) as rec:
        model(d["row"], d["row_positions"], None, packed_seq_params=d["params"])
    packed = to_packed(padded, d["keep"].long(), multiple=MULTIPLE)
    on_row = rec.routes.to("cpu")
    same = (
        on_row.indices[0, packed.routes.mask[0]].sort(-1).values
        == packed.routes.indices[0, packed.routes.mask[0]].sort(-1).values
    )
    report(results, "THD row routes as the padded batch (bf16, TE attention)", bool(same.float().mean() > 0.95),
           f"{same.all(-1).float().mean():.4f} of token-layer entries identical")  # fmt: skip
    share = forced(
        model, lambda: model(d["row"], d["row_positions"], None, packed_seq_params=d["params"]), packed.routes
    )
    report(
        results,
        "replay of to_packed(padded) on the THD row forces every recorded entry",
        share == 1.0,
        f"{share:.4f}",
    )
    torch.save({"padded": padded, "packed": packed}, out / "reference.pt")


def cp_run(results: list[bool], out: Path, cp: int) -> None:
    """CP = world size: per sequence and per document, against OUT/reference.pt."""
    from megatron.core import parallel_state as ps

    from moe_replay.engines.megatron import record_routes
    from moe_replay.routes import cp_positions, from_cp, thd_cp_positions, to_cp

    ref = torch.load(out / "reference.pt", weights_only=False)
    d, model, rank = data(), build(cp), ps.get_context_parallel_rank()
    cu = ref["packed"].cu_seqlens_padded
    runs = {  # name: (the CP = 1 routes, the layout, this rank's positions, its forward on them)
        "per sequence": (ref["padded"], None, cp_positions(T, cp, rank).cuda(),
                         lambda at: model(d["tokens"][:, at], d["position_ids"][:, at], None)),
        "per document": (ref["packed"].routes, cu, thd_cp_positions(cu, cp, rank).cuda(),
                         lambda at: model(d["row"][:, at], d["row_positions"][:, at], None,
                                          packed_seq_params=d["params"])),
    }  # fmt: skip
    for name, (whole, layout, at, forward) in runs.items():
        with torch.no_grad(), record_routes(model) as rec:
            forward(at)
        parts = [None] * cp
        torch.distributed.all_gather_object(parts, rec.routes.to("cpu"))
        joined, mask = from_cp(parts), whole.mask
        same = (joined.indices[mask].sort(-1).values == whole.indices[mask].sort(-1).values).all(-1).float().mean()
        report(results, f"CP={cp} {name}: recorded parts join into the CP=1 routes", bool(same > 0.95), f"{same:.4f}")
        share = forced(model, functools.partial(forward, at), to_cp(whole, cp, rank, cu_seqlens_padded=layout))
        report(results, f"CP={cp} {name}: replay forces the CP=1 routes on rank {rank}", share == 1.0, f"{share:.4f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from megatron.core import parallel_state as ps

    world = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl", rank=int(os.environ.get("RANK", "0")), world_size=world)
    ps.initialize_model_parallel(context_parallel_size=world)
    results: list[bool] = []
    try:
        if world == 1:
            te_split(results)
            one_gpu(results, args.out)
        else:
            cp_run(results, args.out, world)
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"checks passed: {sum(results)}/{len(results)}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
