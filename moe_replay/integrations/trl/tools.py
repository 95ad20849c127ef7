"""TRL's tool-calling loop (`GRPOTrainer(tools=...)`): one `generate` per turn, each over a subset of the batch's rows
(prompt + completion so far + the tool's reply), its output truncated to the completion budget. The routes each turn
recorded are assembled by the segment rule (routes/segments.py: a position's route comes from the forward whose output
there the next token was sampled from; the tool's tokens from the first forward that computed them) into the routes of
one generate over the final prompts and completions, which `routes_for_batch` then lays out like a single turn's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...errors import ReplayError
from ...routes import Routes
from ...routes.segments import Segment, assemble_routes
from .layout import padded

# One `_generate_single_turn` call: its routes under generate [R, P_c + C_c, L, K], its R inputs, its R outputs.
Turn = tuple[Routes, Sequence[Sequence[int]], Sequence[Sequence[int]]]


def tool_loop_routes(
    turns: Sequence[Turn],
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_to_multiple_of: int | None = None,
) -> Routes:
    """The routes of TRL's tool loop, `turns` in the order they ran, as one generate over TRL's final `prompt_ids`
    and `completion_ids` would have recorded them: [B, P + C, L, K], prompts left-padded to P (the longest prompt,
    rounded up to `pad_to_multiple_of`), completions after them. Raises `ReplayError` when a turn's rows cannot be
    found among the final rows (TRL changed how it builds a turn's input).

    Example:
        >>> routes = tool_loop_routes(turns, prompt_ids, completion_ids)  # doctest: +SKIP
    """
    finals = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    B, lp = len(finals), [len(p) for p in prompt_ids]
    P = padded(max(lp, default=0), pad_to_multiple_of)
    width = P + max((len(c) for c in completion_ids), default=0)
    layout = torch.zeros(B, width, dtype=torch.long)
    for i, final in enumerate(finals):
        layout[i, P - lp[i] : P - lp[i] + len(final)] = 1
    segments = [_segment(n, turn, finals, pad_to_multiple_of) for n, turn in enumerate(turns)]
    return assemble_routes(segments, layout)


def _segment(n: int, turn: Turn, finals: list[list[int]], multiple: int | None) -> Segment:
    """Turn `n` as a segment of all B conversations (the rows it did not run are empty in it)."""
    routes, inputs, outputs = turn
    B, (R, T) = len(finals), routes.shape[:2]
    P = padded(max((len(x) for x in inputs), default=0), multiple)
    if R != len(inputs) or R != len(outputs) or P + max((len(o) for o in outputs), default=0) > T:
        raise ReplayError(
            f"tool-loop turn {n} recorded routes of {R} rows x {T} positions for {len(inputs)} inputs (left-padded "
            f"to {P}) and {len(outputs)} outputs (up to {max((len(o) for o in outputs), default=0)} tokens)"
        )
    rows = _rows_of(n, inputs, outputs, finals)
    indices = torch.zeros((B, T, *routes.indices.shape[2:]), dtype=routes.indices.dtype, device=routes.indices.device)
    mask = torch.zeros((B, T), dtype=torch.bool, device=routes.mask.device)
    real = torch.zeros((B, T), dtype=torch.long)
    sampled_from = [0] * B
    for r, i in enumerate(rows):
        x, kept = inputs[r], _common(outputs[r], finals[i][len(inputs[r]) :])
        real[i, P - len(x) : P + kept] = 1  # (the output past where TRL truncated it is not the conversation's)
        indices[i], mask[i] = routes.indices[r], routes.mask[r] & real[i].bool().to(mask.device)
        sampled_from[i] = len(x) - 1
    return Segment(Routes(indices, mask, routes.layers), real, version=0, sampled_from=sampled_from)


def _rows_of(
    n: int, inputs: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], finals: list[list[int]]
) -> list[int]:
    """Which final row each of turn `n`'s rows is: the first of the rows after the previous one's whose final
    sequence starts with its input and goes on with its output (TRL runs a turn over its rows in batch order)."""
    rows, last = [], -1
    for r, (x, y) in enumerate(zip(inputs, outputs, strict=True)):
        x = list(x)
        found = [i for i in range(last + 1, len(finals)) if finals[i][: len(x)] == x]
        ahead = [i for i in found if _common(y, finals[i][len(x) :]) == min(len(y), len(finals[i]) - len(x))]
        if not ahead:
            raise ReplayError(
                f"tool-loop turn {n}, row {r}: its input of {len(x)} tokens and output of {len(y)} start none of the "
                f"final rows after row {last} ({len(found)} start with the input alone; TRL builds a turn's input as "
                "prompt + completion + tool reply, and cuts only the end of its output)"
            )
        rows.append(ahead[0])
        last = rows[-1]
    return rows


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
