"""Routes that vLLM returns (`enable_return_routed_experts`) as a `Routes` batch, one row per completion.

Formats, checked against vLLM's source (see docs/engines.md for the files and versions):

- **per completion** (vLLM ~0.14-0.20, `vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`, and again
  after 0.21, `.../routed_experts_capture/manager.py`): `CompletionOutput.routed_experts`, a numpy array
  (prompt + completion - 1, num_hidden_layers, K) in int32 (older) or uint8 / uint16 (newer, by expert count); one
  column per decoder layer, dense layers' columns left zero. The OpenAI-compatible server's
  `choices[i].routed_experts` is base64 of an `.npy` file.
- **split** (vLLM 0.21.0, `docs/training/routed_experts_replay.md`): `RequestOutput.prompt_routed_experts`
  (prompt, MoE layers, K) plus `CompletionOutput.routed_experts` (completion - 1, MoE layers, K), int16; the server
  gives both as nested lists (`prompt_routed_experts`, `choices[i].routed_experts`). Prompt positions served from the
  prefix cache come back zero (or -1): they are left unrecorded here (routed live in a replay), as many as
  `RequestOutput.num_cached_tokens` says (else the leading run of all-zero positions).

With n > 1, a request's completions come in `CompletionOutput.index` order; each holds the prompt's routes.

Read at (vllm-project/vllm): `vllm/model_executor/layers/fused_moe/routed_experts_capturer.py` (commit 00bd1493,
int32, `num_hidden_layers` columns, `request.num_tokens - 1` rows) with `vllm/outputs.py` (003d3ee2); the 0.21.0
`docs/training/routed_experts_replay.md` (0087e005); `.../routed_experts_capture/manager.py` (3de009db, uint8 /
uint16) and `tests/entrypoints/rlhf/return_routed_experts/test_openai_api.py` (217fd0d4, base64 `.npy`). The newest
documentation describes a redesign keyed by KV block hash whose output format is not covered yet.

Example:
    >>> outputs = llm.generate(prompts, SamplingParams(n=4))  # LLM(..., enable_return_routed_experts=True)
    >>> routes = routes_from_vllm(outputs, model)  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..routes import LayerInfo, Routes
from .rollout import check_columns, check_row_length, count, decoder_layers, layers_of

FLAG = "start vLLM with enable_return_routed_experts=True (LLM(...) argument, or --enable-return-routed-experts)"


def routes_from_vllm(
    outputs: Sequence[Any],
    model: nn.Module | Sequence[LayerInfo],
    *,
    pad_left: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
) -> Routes:
    """One row per completion (requests in order, then completions by index) of vLLM's `RequestOutput`s, or of
    OpenAI-server response dicts; row i covers its prompt and completion tokens from offset `pad_left[i]` (default
    0) in a [B, T] batch. The trainer `model` (or a list of `LayerInfo`) names the layers, E and K; a decoder layer
    without a router loses its column. Raises ValueError, naming both sides, for a row whose length is not
    prompt + completion - 1, L, K or E that do not match, bad ids, or outputs without routes.

    Example:
        >>> routes = routes_from_vllm(llm.generate(prompts, params), model)  # doctest: +SKIP
    """
    layers = layers_of(model)
    if isinstance(outputs, Mapping) or hasattr(outputs, "outputs"):  # one RequestOutput or response, not a list
        outputs = [outputs]
    rows, empties = [], False
    for r, out in enumerate(outputs):
        for row, split in _rows_of(out, r):
            rows.append(row)
            empties |= split
    for row in rows:
        check_columns("vLLM", row.shape[1], layers, None if isinstance(model, Sequence) else decoder_layers(model))
    return Routes.from_rows(rows, layers, pad_left=pad_left, seq_len=seq_len, zeros_empty=empties)


def _rows_of(out: Any, r: int) -> list[tuple[np.ndarray, bool]]:
    """[(routes of each completion of request `r`, whether the prompt routes came separately)]. A completions-endpoint
    response gives each choice its prompt's ids (several prompts may share one response); others give them once."""
    server = isinstance(out, Mapping)
    get = out.get if server else lambda key, default=None: getattr(out, key, default)
    shared = get("prompt_token_ids")
    choices = get("choices") if server else get("outputs")
    if not choices:
        raise ValueError(f"vLLM output {r} has no completions")
    prompt_routes = get("prompt_routed_experts")
    prompt_routes = None if prompt_routes is None else _array(prompt_routes)
    found = []
    for c in sorted(choices, key=lambda c: _field(c, "index") or 0):
        where = f"output {r}, completion {_field(c, 'index') or 0}"
        own = _field(c, "prompt_token_ids")
        prompt = count(shared if own is None else own, "prompt_token_ids", f"vLLM {where}")
        completion = count(_field(c, "token_ids"), "token_ids", f"vLLM {where}")
        routes = _field(c, "routed_experts")
        if routes is None:
            raise ValueError(f"vLLM {where} holds no routed_experts: {FLAG}")
        routes = _array(routes)
        if prompt_routes is not None:  # the split form: prompt routes, then completion - 1 rows
            if routes.size == 0:  # a one-token completion: no rows (a server's `[]`)
                routes = routes.reshape(0, *prompt_routes.shape[1:])
            check_row_length("vLLM", f"{where} (prompt part)", prompt_routes.shape[0], prompt, 1)
            check_row_length("vLLM", f"{where} (completion part)", routes.shape[0], 0, completion)
            if prompt_routes.shape[1:] != routes.shape[1:]:
                raise ValueError(
                    f"vLLM {where}: prompt routes have (layers, K) = {prompt_routes.shape[1:]} but completion "
                    f"routes {routes.shape[1:]}"
                )
            prompt_part = _cached_unrecorded(prompt_routes, _cached_tokens(out, server))
            routes = np.concatenate([prompt_part, routes.astype(prompt_part.dtype, copy=False)])
        check_row_length("vLLM", where, routes.shape[0], prompt, completion)
        found.append((routes, prompt_routes is not None))
    return found


def _cached_tokens(out: Any, server: bool) -> int | None:
    """The prompt tokens vLLM served from its prefix cache (`RequestOutput.num_cached_tokens`, or the server's
    `usage.prompt_tokens_details.cached_tokens`); None where it does not say."""
    if not server:
        found = getattr(out, "num_cached_tokens", None)
    else:
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        found = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return None if found is None else int(found)


def _cached_unrecorded(prompt_routes: np.ndarray, cached: int | None) -> np.ndarray:
    """The split form's prompt routes with the positions its prefix cache served set to -1 (unrecorded): those
    among the first `cached` whose ids are zero in every layer; without `cached`, the leading run of such positions
    (the cache serves a prefix). At K = 1 an all-zero position may also be a real route to expert 0 in every layer,
    so zeros alone cannot tell (found by review: they were replayed as expert 0)."""
    n = prompt_routes.shape[0]
    zero = (prompt_routes == 0).reshape(n, -1).all(1)
    lead = (int(zero.argmin()) if not zero.all() else n) if cached is None else min(cached, n)
    if not zero[:lead].any():
        return prompt_routes
    marked = prompt_routes.astype(np.int32)
    marked[:lead][zero[:lead]] = -1
    return marked


def _field(choice: Any, key: str) -> Any:
    return choice.get(key) if isinstance(choice, Mapping) else getattr(choice, key, None)


def _array(value: Any) -> np.ndarray:
    """A numpy array from vLLM's forms: an array, a tensor, nested lists, or base64 of an `.npy` file."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, str | bytes):
        raw = base64.b64decode(value)
        try:
            return np.load(io.BytesIO(raw), allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"vLLM routed_experts string is not base64 of an .npy array ({len(raw)} bytes)") from e
    array = np.asarray(value)
    if array.ndim != 3 and array.size:  # (an empty one: a one-token completion's part of the split form)
        raise ValueError(f"vLLM routed_experts must be [positions, layers, K], got shape {array.shape}")
    return array
