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

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..routes import LayerInfo, Routes
from ..routes_rows import pad_offsets
from .rollout import check_columns, check_row_length, decoder_layers, layers_of

FLAG = "launch SGLang with --enable-return-routed-experts and send return_routed_experts=True with the request"


def routes_from_sglang(
    responses: Sequence[Mapping[str, Any]],
    model: nn.Module | Sequence[LayerInfo],
    *,
    pad_left: Sequence[int] | torch.Tensor | None = None,
    seq_len: int | None = None,
    num_layers: int | None = None,
) -> Routes:
    """One row per SGLang response dict (`Engine.generate` or the native HTTP API; or an OpenAI-style response with
    `sglext`), covering its prompt and completion tokens from offset `pad_left[i]` (default 0) of a [B, T] batch.
    The trainer `model` (or a list of `LayerInfo`) names the layers, E and K, and gives the payload's column count
    (`num_hidden_layers`; `num_layers` overrides it, else it is read off the payload's size). Raises ValueError,
    naming both sides, for a payload whose size is not a multiple of columns x K x 4 bytes, a row whose length is
    not prompt + completion - 1, L, K or E that do not match, bad ids, or responses without routes.

    Example:
        >>> routes = routes_from_sglang(responses, model, pad_left=[2, 0])  # doctest: +SKIP
    """
    layers = layers_of(model)
    if isinstance(responses, Mapping):  # one response (`Engine.generate` of one prompt), not a list
        responses = [responses]
    K = layers[0].top_k
    columns = num_layers or (None if isinstance(model, Sequence) else decoder_layers(model))
    decoded = [_decode(resp, i, K, columns) for i, resp in enumerate(responses)]
    for row, _ in decoded:
        check_columns("SGLang", row.shape[1], layers, columns)
    starts = [p + start for p, (_, start) in zip(pad_offsets(pad_left, len(decoded)), decoded, strict=True)]
    return Routes.from_rows([row for row, _ in decoded], layers, pad_left=starts, seq_len=seq_len)


def _decode(resp: Mapping[str, Any], i: int, K: int, columns: int | None) -> tuple[np.ndarray, int]:
    """Response `i`'s routes [prompt + completion - 1 - start, columns, K] int32, checked against its token counts,
    and `start` (`routed_experts_start_len`: the routes cover positions start .. prompt + completion - 2)."""
    meta = resp.get("meta_info") or {}
    payload = meta.get("routed_experts")
    if payload is None:
        payload = (resp.get("sglext") or {}).get("routed_experts")
    if payload is None:
        raise ValueError(f"SGLang response {i} has no meta_info['routed_experts']: {FLAG}")
    counts = meta
    if "prompt_tokens" not in meta:  # an OpenAI-style response: its token counts are in `usage`
        if len(resp.get("choices") or ()) > 1:
            raise ValueError(
                f"SGLang response {i} holds {len(resp['choices'])} choices: an OpenAI-style response counts their "
                "completion tokens together in usage, so each one's routes cannot be placed; request n=1 per prompt, "
                "or use the native API"
            )
        counts = resp.get("usage") or {}
    try:
        prompt, completion = int(counts["prompt_tokens"]), int(counts["completion_tokens"])
    except KeyError as e:
        raise ValueError(
            f"SGLang response {i}: neither meta_info nor usage holds {e.args[0]!r}, needed to check its routes"
        ) from e
    raw = base64.b64decode(payload) if isinstance(payload, str | bytes) else None
    if raw is None:
        raise ValueError(f"SGLang response {i}: routed_experts must be a base64 string, got {type(payload).__name__}")
    start = int(meta.get("routed_experts_start_len") or 0)
    positions = prompt + completion - 1 - start
    if columns is None:  # read the column count off the size
        per_row = positions * K * 4
        columns = len(raw) // per_row if per_row and len(raw) % per_row == 0 else None
        if columns is None:
            raise ValueError(
                f"SGLang response {i}: {len(raw)} bytes of routes are not {positions} positions x C columns x "
                f"K={K} x 4 bytes for any C"
            )
    if len(raw) % (columns * K * 4):
        raise ValueError(
            f"SGLang response {i}: {len(raw)} bytes of routes are not a multiple of L x K x 4 = {columns} x {K} x 4 "
            f"(int32 ids, {columns} decoder layers, top-{K})"
        )
    array = np.frombuffer(raw, dtype="<i4").reshape(-1, columns, K)
    check_row_length("SGLang", f"response {i}", array.shape[0] + start, prompt, completion)
    return array, start
