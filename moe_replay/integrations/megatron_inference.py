"""Routes that megatron-core's own inference engine returns (`DynamicInferenceEngine`, a model built with
`moe_enable_routing_replay=True`) as a `Routes` batch, one row per request.

Formats, read in megatron-core 0.19.2's source:

- **in process** (`inference/inference_request.py`): `DynamicInferenceRequest.routing_indices`, a numpy array
  [prompt + generated − 1, num_layers, K] (int16 here; one column per layer the engine records), rebuilt from the
  per-KV-block store when a request finishes (`engines/dynamic_engine.py`) and only for a request that was neither
  evicted nor resumed: otherwise it is None. A `DynamicInferenceRequestRecord` is merged (`.merge()`) first.
- **serialized** (`DynamicInferenceRequest.serialize()`, what the engine's coordinator sends): the same fields in a
  dict, the routes as `("ndarray", {"data": nested lists, "dtype": "int16"})`, token lists as `("tensor", list)`; a
  dropped prompt leaves `prompt_tokens` None and `prompt_length` set.
- **server** (`text_generation_server/.../endpoints/completions.py` and `chat_completions.py`): each of a response's
  `choices` holds `prompt_token_ids`, `generation_token_ids` and `moe_topk_indices` (the serialized routes; the
  prompt part again in `prompt_moe_topk_indices`, ignored here).

Example:
    >>> records = engine.generate(prompts, sampling_params)  # doctest: +SKIP
    >>> routes = routes_from_megatron_inference(records, model)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..routes import LayerInfo, Routes
from .payload import routes_array, shown, token_count, whole
from .rollout import batch_length, check_columns, check_row_length, decoder_layers, from_engine_rows, layers_of

NONE = (
    "holds no routing_indices: megatron-core rebuilds them only for a request that was neither evicted nor resumed, "
    "and records them only for a model built with moe_enable_routing_replay=True"
)


def routes_from_megatron_inference(
    requests: Sequence[Any],
    model: nn.Module | Sequence[LayerInfo],
    *,
    pad_left: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
) -> Routes:
    """One row per request of megatron-core's inference engine (`DynamicInferenceRequest`s or their records, their
    `serialize()` dicts, or the text-generation server's response dicts, one row per choice), covering its prompt and
    generated tokens from offset `pad_left[i]` (default 0) of a [B, T] batch, T (default) the longest
    `pad_left[i] + prompt + generated`. The trainer `model` (or a list of `LayerInfo`) names the layers, E and K.
    Raises ValueError naming the request, its field and both sides: a request without routes (evicted, resumed, or
    recording off), a row whose length is not prompt + generated − 1, L, K or E that do not match, bad ids.

    Example:
        >>> routes = routes_from_megatron_inference(engine.generate(prompts, params), model)  # doctest: +SKIP
    """
    layers = layers_of(model)
    if isinstance(requests, Mapping) or hasattr(requests, "routing_indices") or hasattr(requests, "merge"):
        requests = [requests]
    if isinstance(requests, str | bytes) or not isinstance(requests, Iterable):
        raise ValueError(f"megatron-core inference requests must be a list, got {shown(requests)}")
    K, decoder = layers[0].top_k, None if isinstance(model, Sequence) else decoder_layers(model)
    rows, names, lengths = [], [], []
    for r, request in enumerate(requests):
        for where, prompt, generated, payload, field in _entries(request, r):
            if payload is None:
                raise ValueError(f"{where} {NONE}")
            row = routes_array(_unwrapped(payload, where, field, K), where, field, K)
            check_row_length(f"{where}, {field}", row.shape[0], prompt, generated)
            check_columns(f"{where}, {field}", row.shape[1], layers, decoder)
            rows.append(row)
            names.append(f"{where}, {field}")
            lengths.append(prompt + generated)
    T = batch_length(lengths, pad_left) if seq_len is None else seq_len
    return from_engine_rows("megatron-core inference", rows, names, layers, pad_left=pad_left, seq_len=T)


def _entries(request: Any, r: int) -> list[tuple[str, int, int, Any, str]]:
    """[(what names it, prompt tokens, generated tokens, routes payload, its field)] of one request or response."""
    where = f"megatron-core request {r}"
    if request is None or isinstance(request, str | bytes | int | float | list | tuple | np.ndarray):
        raise ValueError(f"{where} is {shown(request)}, not a request, its serialized dict or a server response")
    if hasattr(request, "merge") and hasattr(request, "requests"):  # a DynamicInferenceRequestRecord
        request = request.merge()
    if isinstance(request, Mapping) and "choices" in request:  # the text-generation server's response
        choices = request["choices"]
        if not isinstance(choices, list | tuple) or not choices:
            raise ValueError(f"{where}: choices must be a non-empty list, got {shown(choices)}")
        found = []
        for j, c in enumerate(choices):
            at = f"{where}, choice {j}"
            if not isinstance(c, Mapping):
                raise ValueError(f"{at} is {shown(c)}, not a choice dict")
            prompt = token_count(_tokens(c.get("prompt_token_ids")), at, "prompt_token_ids")
            generated = token_count(_tokens(c.get("generation_token_ids")), at, "generation_token_ids")
            found.append((at, prompt, generated, c.get("moe_topk_indices"), "moe_topk_indices"))
        return found
    get = request.get if isinstance(request, Mapping) else lambda key, default=None: getattr(request, key, default)
    prompt_tokens = _tokens(get("prompt_tokens"))
    if prompt_tokens is None:  # (a serialized request whose prompt was dropped keeps its length)
        if get("prompt_length") is None:
            raise ValueError(f"{where} holds neither prompt_tokens nor prompt_length, needed to check its routes")
        prompt = whole(get("prompt_length"), where, "prompt_length")
    else:
        prompt = token_count(prompt_tokens, where, "prompt_tokens")
    generated = token_count(_tokens(get("generated_tokens")), where, "generated_tokens")
    return [(where, prompt, generated, get("routing_indices"), "routing_indices")]


def _tokens(value: Any) -> Any:
    """A token list without `serialize()`'s ("tensor", list) wrapper."""
    if isinstance(value, list | tuple) and len(value) == 2 and value[0] == "tensor":
        return value[1]
    return value


def _unwrapped(payload: Any, where: str, field: str, K: int) -> Any:
    """The routes without `serialize()`'s ("ndarray", {"data", "dtype"}) wrapper, as an array of that dtype."""
    if not (isinstance(payload, list | tuple) and len(payload) == 2 and payload[0] == "ndarray"):
        return payload
    inner = payload[1]
    if not isinstance(inner, Mapping) or "data" not in inner or "dtype" not in inner:
        raise ValueError(f"{where}, {field}: a serialized ndarray needs 'data' and 'dtype', got {shown(inner)}")
    try:
        dtype = np.dtype(inner["dtype"])
    except TypeError as e:
        raise ValueError(f"{where}, {field}: dtype {shown(inner['dtype'])} is not a numpy dtype") from e
    if dtype.kind not in "iu":
        raise ValueError(f"{where}, {field}: routes must hold integer expert ids, got dtype {dtype}")
    checked = routes_array(inner["data"], where, field, K)
    if checked.size and (checked.min() < np.iinfo(dtype).min or checked.max() > np.iinfo(dtype).max):
        raise ValueError(f"{where}, {field}: ids outside the range of the stated dtype {dtype}")
    return checked.astype(dtype)
