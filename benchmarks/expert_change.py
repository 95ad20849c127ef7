"""Time `expert_change` (fraction, set_changed, token_changed) on 1e7 routed entries: [64, 2048, 10, 8], E = 64.

python benchmarks/expert_change.py
"""

from __future__ import annotations

import statistics
import time

import torch

from moe_replay import LayerInfo, Routes, expert_change


def main(B: int = 64, T: int = 2048, L: int = 10, K: int = 8, E: int = 64, repeats: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    a = torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :K]
    b = a.clone()
    moved = torch.rand(B, T, L, generator=g) < 0.1  # about 10% of (token, layer) sets re-drawn
    b[moved] = torch.rand(int(moved.sum()), E, generator=g).argsort(-1)[:, :K]
    mask = torch.ones(B, T, dtype=torch.bool)
    layers = [LayerInfo(f"layer{i}", E, K) for i in range(L)]
    before, after = Routes(a, mask, layers), Routes(b, mask, layers)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = expert_change(before, after)
        _ = (c.fraction, c.set_changed, c.token_changed)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    print(
        f"expert_change on {before.indices.numel():.2e} entries {list(before.shape)}: median {median:.3f} s "
        f"over {repeats} runs, {torch.get_num_threads()} threads; fraction={c.fraction:.4f}"
    )
    return median


if __name__ == "__main__":
    main()
