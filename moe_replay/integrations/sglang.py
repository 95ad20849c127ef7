"""Routes that SGLang returns (`--enable-return-routed-experts`, `return_routed_experts=True` per request) as a
`Routes` batch, one row per response.

Format, checked against SGLang's source (see docs/engines.md for the files and versions): `meta_info["routed_experts"]`
is base64 of the raw bytes of an int32 array (seq_len - 1, num_hidden_layers, K), native (little-endian) byte order,
no shape in the payload; seq_len = prompt + completion tokens (`meta_info["prompt_tokens"]`,
`meta_info["completion_tokens"]`). One column per decoder layer, dense layers' columns left zero. The
OpenAI-compatible endpoints put the same string in `sglext.routed_experts`, and the token counts in `usage` (one
choice per response: `usage` sums several). With n > 1, responses come prompt-major
(p0s0, p0s1, ..., p1s0, ...), each with the prompt's routes. Prompt tokens served from the radix cache carry the
routes stored when they were first computed. A request with `routed_experts_start_len=s` gets positions
s .. seq_len - 2 only (`meta_info["routed_experts_start_len"]`): the first s positions are left unrecorded.

Read at: `python/sglang/srt/layers/moe/routed_experts_capturer.py` (commit d4d0fc58) and, in later releases,
`python/sglang/srt/state_capturer/routed_experts.py` (commit bec3dbc9): the capturer keeps one column per
`num_hidden_layers` and returns `req_to_token[start_len : seqlen - 1]`; `tokenizer_manager.py` base64-encodes
`tensor.numpy().tobytes()`.

Example:
    >>> responses = engine.generate(input_ids=ids, sampling_params=p, return_routed_experts=True)  # doctest: +SKIP
    >>> routes = routes_from_sglang(responses, model, pad_left=pad)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..routes import LayerInfo, Routes
from ..routes.rows import pad_offsets
from .payload import base64_bytes, mapping, shown, whole
from .rollout import (
    batch_length,
    check_columns,
    check_row_length,
    decoder_layers,
    from_engine_rows,
    layers_of,
    start_offsets,
)

FLAG = "launch SGLang with --enable-return-routed-experts and send return_routed_experts=True with the request"


def routes_from_sglang(
    responses: Sequence[Mapping[str, Any]],
    model: nn.Module | Sequence[LayerInfo],
    *,
    pad_left: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
    num_layers: int | None = None,
    start_len: int | Sequence[int] | torch.Tensor | None = None,
) -> Routes:
    """One row per SGLang response dict (`Engine.generate` or the native HTTP API; or an OpenAI-style response with
    `sglext`, or with `return_meta_info=true` one row per choice), covering its prompt and completion tokens from
    offset `pad_left[i]` (default 0) of a [B, T] batch, T (default) the longest `pad_left[i] + prompt + completion`.
    `start_len` is the `routed_experts_start_len` the requests were sent with (one for all, or one per response;
    SGLang 0.5.23 does not echo it in `meta_info`): the routes then begin at that position and the ones before it
    stay unrecorded. The trainer `model` (or a list of `LayerInfo`) names the layers, E and K, and gives the payload's
    column count (`num_hidden_layers`; `num_layers` overrides it, and is needed with a list of `LayerInfo`: the payload
    has no shape, and its size fits more than one split). Raises
    ValueError, naming the response ("SGLang response 3"), its field and both sides, for a payload that is not
    base64 or whose size is not a multiple of columns x K x 4 bytes, a row whose length is not prompt + completion -
    1 - start_len, null or non-integer counts, L, K or E that do not match, bad ids, or responses without routes.

    Example:
        >>> routes = routes_from_sglang(responses, model, pad_left=[2, 0])  # doctest: +SKIP
    """
    layers = layers_of(model)
    if isinstance(responses, Mapping):  # one response (`Engine.generate` of one prompt), not a list
        responses = [responses]
    if isinstance(responses, str | bytes) or not isinstance(responses, Iterable):
        raise ValueError(f"SGLang responses must be a list of response dicts, got {shown(responses)}")
    responses = list(responses)
    K = layers[0].top_k
    decoder = None if isinstance(model, Sequence) else decoder_layers(model)
    columns = decoder if num_layers is None else whole(num_layers, "SGLang", "num_layers") or None
    if columns is None:  # (read off the size, a start_len off by one re-read 5 positions x 4 columns as 4 x 5)
        raise ValueError(
            "SGLang's routes carry no shape, and a list of LayerInfo does not say how many decoder layers (columns) "
            "they hold, which more than one split of a payload's size fits: pass num_layers= (the model's "
            "num_hidden_layers), or the model itself"
        )
    given = start_offsets(start_len, len(responses), "start_len")
    decoded = [
        _decode(where, meta, counts, holder, payload, field, given[i] if start_len is not None else None, K, columns)
        for i, resp in enumerate(responses)
        for where, meta, counts, holder, payload, field in _entries(resp, i)
    ]
    for row, _, name, _ in decoded:
        check_columns(name, row.shape[1], layers, columns)
    pads = pad_offsets(pad_left, len(decoded))
    T = batch_length([tokens for *_, tokens in decoded], pads) if seq_len is None else seq_len
    starts = [p + start for p, (_, start, _, _) in zip(pads, decoded, strict=True)]
    rows, names = [row for row, *_ in decoded], [name for _, _, name, _ in decoded]
    return from_engine_rows("SGLang", rows, names, layers, pad_left=starts, seq_len=T)


def _entries(resp: Any, i: int) -> list[tuple[str, Mapping, Mapping, str, Any, str]]:
    """[(what names it, its meta_info, the dict holding its token counts and that dict's name, the routes payload,
    its field)]: one per response, or one per choice of an OpenAI-style response with per-choice meta_info."""
    where = f"SGLang response {i}"
    if not isinstance(resp, Mapping):
        raise ValueError(f"{where} is {shown(resp)}, not a response dict")
    meta = mapping(resp.get("meta_info"), where, "meta_info")
    choices = resp.get("choices")
    if choices is not None and not isinstance(choices, list | tuple):
        raise ValueError(f"{where}: choices must be a list, got {shown(choices)}")
    if choices and any(isinstance(c, Mapping) and c.get("meta_info") is not None for c in choices):
        found = []  # (`return_meta_info=true`: each choice carries the engine's meta_info, routes and counts)
        for j, c in enumerate(choices):
            at = f"{where}, choice {j}"
            own = mapping(c.get("meta_info") if isinstance(c, Mapping) else c, at, "meta_info")
            found.append((at, own, own, "meta_info", own.get("routed_experts"), "meta_info['routed_experts']"))
        return found
    payload, field = meta.get("routed_experts"), "meta_info['routed_experts']"
    if payload is None and "sglext" in resp:  # an OpenAI-style response
        payload, field = mapping(resp["sglext"], where, "sglext").get("routed_experts"), "sglext['routed_experts']"
    counts, holder = meta, "meta_info"
    if "prompt_tokens" not in meta:  # an OpenAI-style response: its token counts are in `usage`
        if choices is not None and len(choices) > 1:
            raise ValueError(
                f"{where} holds {len(choices)} choices: an OpenAI-style response counts their completion tokens "
                "together in usage, so each one's routes cannot be placed; send return_meta_info=true (each choice "
                "then carries its own), request n=1 per prompt, or use the native API"
            )
        counts, holder = mapping(resp.get("usage"), where, "usage"), "usage"
    return [(where, meta, counts, holder, payload, field)]


def _decode(
    where: str,
    meta: Mapping,
    counts: Mapping,
    holder: str,
    payload: Any,
    field: str,
    given: int | None,
    K: int,
    columns: int,
) -> tuple[np.ndarray, int, str, int]:
    """One row's routes [prompt + completion - 1 - start, columns, K] int32, checked against its token counts;
    `start` (the `routed_experts_start_len` given, or echoed in `meta_info`: the routes cover positions start ..
    prompt + completion - 2); what names it; and its prompt + completion tokens."""
    if payload is None:
        raise ValueError(f"{where} has no {field}: {FLAG}")
    for key in ("prompt_tokens", "completion_tokens"):
        if key not in counts:
            side = "neither meta_info nor usage" if holder == "usage" else holder
            raise ValueError(f"{where}: {side} holds {key!r}, needed to check its routes")
    prompt = whole(counts["prompt_tokens"], where, f"{holder}['prompt_tokens']")
    completion = whole(counts["completion_tokens"], where, f"{holder}['completion_tokens']")
    echoed = meta.get("routed_experts_start_len")
    echoed = None if echoed is None else whole(echoed, where, "meta_info['routed_experts_start_len']")
    if echoed is not None and given is not None and echoed != given:
        raise ValueError(f"{where}: start_len={given} was given but meta_info says routed_experts_start_len={echoed}")
    start = echoed if echoed is not None else given or 0
    if prompt + completion < 1:
        raise ValueError(f"{where}: {holder} counts no tokens, so no positions its routes could cover")
    positions = prompt + completion - 1 - start
    if positions < 0:
        raise ValueError(
            f"{where}: routed_experts_start_len={start} is past its prompt + completion - 1 = "
            f"{prompt + completion - 1} positions"
        )
    raw = base64_bytes(payload, where, field, empty=positions == 0)
    at = f"{where}, {field}"
    if len(raw) % (columns * K * 4):
        raise ValueError(
            f"{at}: {len(raw)} bytes of routes are not a multiple of L x K x 4 = {columns} x {K} x 4 (int32 ids, "
            f"{columns} decoder layers, top-{K})"
        )
    array = np.frombuffer(raw, dtype="<i4").reshape(-1, columns, K)
    check_row_length(at, array.shape[0], prompt, completion, start, "routed_experts_start_len")
    return array, start, at, prompt + completion
