"""Routes recorded while TRL generated, laid out exactly as TRL lays out its batch, with every step checked.

TRL (1.16, `GRPOTrainer._generate_single_turn` and `_generate_and_score_completions`) keeps each completion up to
and including its first EOS, pads prompts on the left and completions on the right (each to a multiple of
`pad_to_multiple_of`), and concatenates them: row i of its [B, P + C] batch holds prompt i at positions
P - lp_i .. P - 1 and completion i at P .. P + lc_i - 1. `generate` saw the same prompts padded the same way, so
its routes hold row i's decisions at positions P_gen - lp_i .. P_gen + lc_i - 2 (the last token is never an input).

Shape legend: B rows, T positions, L MoE layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...errors import ReplayError
from ...routes import Routes


def recorded_span(
    prompt_lens: Sequence[int], completion_lens: Sequence[int], prompt_width: int, width: int
) -> torch.Tensor:
    """bool [B, width]: the positions whose routes a generation records in a layout whose prompts are left-padded
    to `prompt_width`: from each row's first prompt token up to, not including, its last completion token.

    Example:
        >>> recorded_span([2], [3], prompt_width=4, width=7).int().tolist()
        [[0, 0, 1, 1, 1, 1, 0]]
    """
    pos = torch.arange(width)
    lp = torch.as_tensor(list(prompt_lens))[:, None]
    lc = torch.as_tensor(list(completion_lens))[:, None]
    return (pos >= prompt_width - lp) & (pos < prompt_width + lc - 1)


def routes_for_batch(
    routes: Routes,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    input_ids: torch.Tensor,
    completion_width: int,
    pad_to_multiple_of: int | None = None,
    *,
    partial: bool = False,
) -> Routes:
    """Lay routes recorded under `generate` [B, P_gen + C_gen] out as TRL's batch `input_ids` [B, P + C], whose last
    `completion_width` (C) positions are the completions; raise `ReplayError` if anything does not line up.

    `generate` saw the prompts left-padded to P_gen, the longest one rounded up to a multiple of `pad_to_multiple_of`
    (TRL's setting of that name). It may have run past where TRL cut a completion, when it stops at fewer end tokens
    than TRL cuts at: the routes after the cut are dropped (routing is causal, so those before it hold).

    `partial`: the routes may leave positions of the rows unrecorded (an engine's `prompt_start` offset); they route
    live. Checks, each naming both sides: the recorded positions up to each row's cut are exactly (with `partial`:
    within) those of the prompt and completion TRL kept (a one-position shift, or a generation that ended before
    TRL's cut, fails here), and `input_ids` holds those prompts and completions where this layout puts them (a
    change of TRL's layout fails here).

    Example:
        >>> rows = routes_for_batch(rec.routes, prompt_ids, completion_ids, input_ids, logits_to_keep)  # doctest: +SKIP
    """
    B = routes.batch_size
    if not (len(prompt_ids) == len(completion_ids) == B == input_ids.shape[0]):
        raise ReplayError(
            f"generate recorded B={B} rows but TRL's batch has {len(prompt_ids)} prompts, {len(completion_ids)} "
            f"completions and {input_ids.shape[0]} rows of input_ids"
        )
    lp = [len(p) for p in prompt_ids]
    lc = [len(c) for c in completion_ids]
    width = input_ids.shape[1]
    prompt_width = width - completion_width
    check_tokens(input_ids, prompt_ids, completion_ids, prompt_width)
    gen_prompt = padded(max(lp, default=0), pad_to_multiple_of)
    T = routes.seq_len
    if T < gen_prompt + max(lc, default=0):
        raise ReplayError(
            f"generate recorded T={T} positions but TRL's prompts, left-padded to {gen_prompt}, and its longest "
            f"completion of {max(lc)} tokens need {gen_prompt + max(lc)}"
        )
    expected = recorded_span(lp, lc, gen_prompt, T)
    cut = torch.arange(T) < torch.as_tensor([gen_prompt + n - 1 for n in lc])[:, None]  # before each row's last token
    got = routes.mask.cpu()
    if partial:  # (an engine may skip a prefix of the prompt: those route live; the rest must be all there)
        empty = expected.any(1) & ~(got & cut).any(1)
        if empty.any():
            raise ReplayError(f"the routes of row {int(empty.nonzero()[0])} record none of its positions")
        first = torch.where(got.any(1), got.float().argmax(1), torch.full((B,), T))
        expected = expected & (torch.arange(T)[None] >= first[:, None])
    if not torch.equal(got & cut, expected):
        i = int((expected != (got & cut)).any(1).nonzero()[0])
        raise ReplayError(
            f"routes recorded under generate do not line up with TRL's row {i}: they cover positions "
            f"{_span(got[i])} but its {lp[i]} prompt and {lc[i]} completion tokens need {_span(expected[i])} "
            f"(generate's prompt width {gen_prompt}, T={T})"
        )
    kept = routes.mask & expected.to(routes.mask.device)  # (past TRL's cut: dropped)
    shift = prompt_width - gen_prompt
    lo, hi = max(0, -shift), min(T, width - shift)
    L, K = len(routes.layers), routes.top_k
    indices = routes.indices.new_zeros((B, width, L, K))
    mask = routes.mask.new_zeros((B, width))
    if lo < hi:
        indices[:, lo + shift : hi + shift] = routes.indices[:, lo:hi]
        mask[:, lo + shift : hi + shift] = kept[:, lo:hi]
    if int(mask.sum()) != int(kept.sum()):
        raise ReplayError(
            f"TRL's batch of width {width} (prompts {prompt_width}) cannot hold every recorded position of "
            f"generate's T={T} (prompts {gen_prompt})"
        )
    return Routes(indices, mask, routes.layers)


def check_rows(batch: dict[str, Any], indices: str, mask: str, tokens: str) -> None:
    """Raise `ReplayError` unless each row of TRL's `batch` holds, where its routes are recorded (`batch[mask]`
    [B, P + C]), the tokens they were recorded for (`batch[tokens]`, set beside `batch[indices]` when the routes were
    attached): rows reordered or replaced without their routes would train on other rows' experts.

    Example:
        >>> check_rows(inputs, "routing_indices", "routing_mask", "routing_tokens")  # doctest: +SKIP
    """
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    held, recorded = batch.get(tokens), batch[mask]
    if held is None or held.shape != ids.shape or recorded.shape != ids.shape:
        raise ReplayError(
            f"TRL's batch has input ids {tuple(ids.shape)} but routes {tuple(batch[indices].shape[:2])} recorded for "
            f"tokens {None if held is None else tuple(held.shape)}: the routes keys ({indices!r}, {mask!r}, "
            f"{tokens!r}) must move with their rows"
        )
    differ = (held != ids) & recorded.to(ids.device)
    if bool(differ.any()):
        rows = differ.any(1).nonzero().flatten().tolist()
        raise ReplayError(
            f"routes in TRL's batch were recorded for other tokens than rows {rows[:8]} hold (of {ids.shape[0]}): "
            f"the rows were reordered or replaced without their routes ({indices!r}, {mask!r}, {tokens!r}), which "
            "would train them on other rows' experts; move those keys with their rows"
        )


def padded(length: int, multiple: int | None) -> int:
    """`length` rounded up to a multiple of `multiple` (None: as it is), as TRL pads its prompts.

    Example:
        >>> padded(5, 4), padded(5, None)
        (8, 5)
    """
    return length if not multiple else -(-length // multiple) * multiple


def check_tokens(
    input_ids: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    prompt_width: int,
) -> None:
    """Raise `ReplayError` unless `input_ids` [B, P + C] holds prompt i left-padded to P = `prompt_width` and
    completion i right after it, in every row.

    Example:
        >>> check_tokens(torch.tensor([[0, 5, 6, 7, 0]]), [[5, 6]], [[7]], prompt_width=3)
    """
    B, width = input_ids.shape
    expected = torch.full((B, width), -1, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        if len(p) > prompt_width or prompt_width + len(c) > width:
            raise ReplayError(
                f"row {i}: {len(p)} prompt and {len(c)} completion tokens do not fit TRL's batch of width {width} "
                f"with {prompt_width} prompt positions"
            )
        expected[i, prompt_width - len(p) : prompt_width] = torch.as_tensor(list(p), dtype=torch.long)
        expected[i, prompt_width : prompt_width + len(c)] = torch.as_tensor(list(c), dtype=torch.long)
    known = expected >= 0
    bad = known & (expected != input_ids.cpu().long())
    if bad.any():
        i, t = (int(v) for v in bad.nonzero()[0])
        raise ReplayError(
            f"TRL's batch does not hold the generated tokens where the routes expect them: row {i}, position {t} "
            f"holds token {int(input_ids[i, t])} but generation gave {int(expected[i, t])} there (prompts "
            f"left-padded to {prompt_width}, completions after them)"
        )


def _span(mask: torch.Tensor) -> str:
    pos = mask.nonzero().flatten().tolist()
    return f"{pos[0]}..{pos[-1]}" if pos else "no positions"
