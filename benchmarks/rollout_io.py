"""Routes at production size: validated `Routes.load`, the vLLM / SGLang importers, `to_packed` and a two-turn
`assemble_routes` against one
plain pass over the same bytes (a base64 decode, a copy), side by side in one run (with A/A rows), and the importers'
peak memory (fresh subprocesses).

    python benchmarks/rollout_io.py            # 256 MiB of routes (L=48, K=8, E=128): a few minutes on 2 cores
    python benchmarks/rollout_io.py --quick    # 64 MiB

Writes benchmarks/results_rollout_io.csv (--quick: results_rollout_io_quick.csv, git-ignored).
"""

from __future__ import annotations

import argparse
import base64
import io
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from run import child_stdout, write_rows

from moe_replay import LayerInfo, Routes, Segment, assemble_routes, to_packed
from moe_replay.integrations.sglang import routes_from_sglang
from moe_replay.integrations.vllm import routes_from_vllm

L, K, E, ROWS = 48, 8, 128, 64
LAYERS = tuple(LayerInfo(f"model.layers.{i}.mlp.gate", E, K) for i in range(L))


def best(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn` over `repeats` runs after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def payload(mib: int) -> tuple[list[np.ndarray], list[dict]]:
    """vLLM-style int32 arrays [n, L, K] and SGLang-style base64 responses for `mib` MiB of final (uint8) routes."""
    n = (mib << 20) // (ROWS * L * K)
    g = torch.Generator().manual_seed(0)
    arrays = [
        ((torch.randint(0, E, (n, L, 1), generator=g) + torch.arange(K) * 13) % E).int().numpy() for _ in range(ROWS)
    ]
    meta = [{"prompt_tokens": n // 2, "completion_tokens": n - n // 2 + 1} for _ in range(ROWS)]
    responses = [
        {"meta_info": {**m, "routed_experts": base64.b64encode(a.tobytes()).decode()}}
        for m, a in zip(meta, arrays, strict=True)
    ]
    return arrays, responses


def vllm_outputs(arrays: list[np.ndarray]) -> list[dict]:
    n = arrays[0].shape[0]
    return [
        {"prompt_token_ids": n // 2, "choices": [{"index": 0, "token_ids": n - n // 2 + 1, "routed_experts": a}]}
        for a in arrays
    ]


def peak_child(kind: str, path: str) -> None:
    """In a fresh process: load the payload, then print the peak RSS growth of importing it (bytes)."""
    with open(path, "rb") as f:
        data = pickle.load(f)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = status_kib("VmRSS")
    sglang = kind == "sglang"
    routes = routes_from_sglang(data, LAYERS, num_layers=L) if sglang else routes_from_vllm(vllm_outputs(data), LAYERS)
    print((status_kib("VmHWM") - before) * 1024, routes.nbytes)


def status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--_peak", nargs=2, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts._peak:
        peak_child(*opts._peak)
        return
    mib, reps = (64, 3) if opts.quick else (256, 5)
    rows: list[dict] = []

    def add(metric: str, ours: float, base: float, unit: str, target: str, met: bool | None) -> None:
        rows.append(
            {
                "metric": metric,
                "ours": ours,
                "baseline": base,
                "unit": unit,
                "ratio": ours / base,
                "target": target,
                "met": "" if met is None else ("yes" if met else "NO"),
            }
        )
        print(f"  {metric}: {ours:.4g} vs {base:.4g} {unit} (ratio {ours / base:.2f}) {target}", flush=True)

    arrays, responses = payload(mib)
    routes = Routes.from_rows(arrays, LAYERS)
    gib = routes.nbytes / 2**30
    with tempfile.TemporaryDirectory() as tmp:
        from safetensors.torch import load_file

        path = Path(tmp) / "routes.safetensors"
        routes.save(path)
        t_plain = best(lambda: load_file(path)["indices"].amax(), reps)
        t_aa = best(lambda: load_file(path)["indices"].amax(), reps)
        t_load = best(lambda: Routes.load(path), reps)
        add(f"validated Routes.load, {gib:.2f} GiB", t_load, t_plain, "s", "ratio <= 25", t_load / t_plain <= 25)
        add("  GiB/s of the validated load", gib / t_load, 1.0, "GiB/s", ">= 1 GiB/s", gib / t_load >= 1.0)
        add("  noise floor: the plain pass against itself", t_aa, t_plain, "s", "(A/A)", None)

        def decode() -> None:
            for r in responses:
                np.frombuffer(base64.b64decode(r["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, L, K)

        t_decode = best(decode, reps)
        t_sglang = best(lambda: routes_from_sglang(responses, LAYERS, num_layers=L), reps)
        add("SGLang import vs base64 decode", t_sglang, t_decode, "s", "ratio <= 2", t_sglang / t_decode <= 2)
        npys = []  # vLLM >= 0.22's server form: base64 of an .npy file, uint8 at <= 256 experts
        for a in arrays:
            buf = io.BytesIO()
            np.save(buf, a.astype(np.uint8))
            npys.append(base64.b64encode(buf.getvalue()).decode())
        n = arrays[0].shape[0]
        server = [
            {"prompt_token_ids": n // 2, "choices": [{"index": 0, "token_ids": n - n // 2 + 1, "routed_experts": b}]}
            for b in npys
        ]
        t_npy = best(lambda: [np.load(io.BytesIO(base64.b64decode(b))) for b in npys], reps)
        t_server = best(lambda: routes_from_vllm(server, LAYERS), reps)
        add(
            "vLLM server import (base64 .npy) vs base64 decode",
            t_server,
            t_npy,
            "s",
            "ratio <= 2",
            t_server / t_npy <= 2,
        )
        keep = torch.ones(routes.mask.shape, dtype=torch.bool)
        keep[::2, : routes.seq_len // 4] = False  # every other row left-padded by a quarter
        padded = Routes(routes.indices, routes.mask & keep, LAYERS)
        t_pass = best(lambda: padded.indices.clone(), reps)
        t_pack = best(lambda: to_packed(padded, keep), reps)
        add(
            "to_packed vs one memory pass (a copy of the routes)",
            t_pack,
            t_pass,
            "s",
            "ratio <= 5",
            t_pack / t_pass <= 5,
        )
        # a two-turn assembly without a kept cache: turn 1 recorded the first half of each row, turn 2 re-ran it all
        whole = torch.ones(routes.mask.shape, dtype=torch.long)
        half = routes.seq_len // 2
        turn1 = Segment(Routes(routes.indices, routes.mask & (torch.arange(routes.seq_len) < half), LAYERS), whole, 0,
                        sampled_from=half // 2)  # fmt: skip
        turn2 = Segment(routes, whole, 1, sampled_from=half)
        t_assemble = best(lambda: assemble_routes([turn1, turn2], whole), reps)
        add(
            "assemble_routes of two turns vs one memory pass (a copy of the routes)",
            t_assemble,
            t_pass,
            "s",
            "ratio <= 5",
            t_assemble / t_pass <= 5,
        )
        t_convert = best(lambda: [torch.from_numpy(a).to(torch.uint8) for a in arrays], reps)
        t_vllm = best(lambda: routes_from_vllm(vllm_outputs(arrays), LAYERS), reps)
        add("vLLM import vs int32 -> uint8 conversion", t_vllm, t_convert, "s", "(none)", None)
        decoded = sum(a.nbytes for a in arrays)
        for kind, data in (("sglang", responses), ("vllm", arrays)):
            dump = Path(tmp) / f"{kind}.pkl"
            dump.write_bytes(pickle.dumps(data))
            out = child_stdout([sys.executable, __file__, "--_peak", kind, str(dump)])
            grew, final = (int(v) for v in out.split())
            bound = (decoded if kind == "sglang" else 0) + 2 * final
            add(
                f"{kind} import: peak memory growth vs {'decoded payload + ' if kind == 'sglang' else ''}2x Routes",
                grew / 2**20,
                bound / 2**20,
                "MiB",
                "ratio <= 1",
                grew <= bound,
            )
    out = Path(__file__).with_name("results_rollout_io_quick.csv" if opts.quick else "results_rollout_io.csv")
    write_rows(out, rows)
    met = [r for r in rows if r["met"]]
    print(f"wrote {out}\ntargets met: {sum(r['met'] == 'yes' for r in met)}/{len(met)}")


if __name__ == "__main__":
    main()
