"""Routes from a custom TRL `rollout_func` (the user's own vLLM / SGLang call or agent loop): the contract, and the
wrapper that takes them out of the rollout's output before TRL hands its extra fields to the reward functions.

The contract: `rollout_func(prompts, trainer)` returns, next to TRL's `prompt_ids`, `completion_ids` and `logprobs`
(and optionally `env_mask` for tool or environment tokens inside the completions), `"routes"`: a `Routes` with one
row per completion, whose position t is token t of that row's prompt + completion (no padding before it), as
`routes_from_vllm` / `routes_from_sglang` lay them out by default. Positions the engine did not record (a
`prompt_start` / `start_len` offset) route live. Routes that know their rows' tokens (`routes_from_vllm`'s, an
`EngineRoutes`) must sit on the same rows of `prompt_ids` + `completion_ids`: rows swapped are refused.

Shape legend: N completions, T positions, L MoE layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ReplayError
from ...routes import Routes
from ..engine_routes import EngineRoutes

ROUTES = "routes"  # the rollout output's key for the routes


def taking_routes(rollout_func: Callable[..., dict[str, Any]], mode: str, keep: Callable[[tuple], None]) -> Callable:
    """`rollout_func` wrapped: its output's `"routes"` go to `keep((routes, prompt_ids, completion_ids))` and are
    removed from the output (TRL would pass them to the reward functions). With `mode` "rollout" (R3) they are
    required; with "old_logprob" (R2, which records its own) they are refused.

    Example:
        >>> trainer.rollout_func = taking_routes(my_rollout, "rollout", store)  # doctest: +SKIP
    """

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        output = rollout_func(prompts, trainer)
        routes = output.pop(ROUTES, None) if isinstance(output, dict) else None
        if mode == "old_logprob":
            if routes is not None:
                raise ValueError(
                    "routing_replay='old_logprob' (R2) records its routes in the old-log-prob pass: the rollout_func's "
                    f"{ROUTES!r} would go unused; drop them, or use routing_replay='rollout' to replay them (R3)"
                )
            return output
        if routes is None:
            raise ReplayError(
                f"routing_replay='rollout' needs the rollout_func to return {ROUTES!r} (a Routes, one row per "
                "completion: e.g. routes_from_vllm(outputs, layers)) next to prompt_ids and completion_ids"
            )
        if not isinstance(routes, Routes):
            raise ValueError(f"the rollout_func's {ROUTES!r} must be a Routes, got {type(routes).__name__}")
        if routes.batch_size != len(output["completion_ids"]):
            raise ValueError(
                f"the rollout_func returned routes for {routes.batch_size} rows but {len(output['completion_ids'])} "
                "completions"
            )
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        if isinstance(routes, EngineRoutes):  # an importer's: each row knows its tokens (rows swapped are refused)
            routes.check_rows(prompt_ids, completion_ids, f"the rollout_func's {ROUTES!r}")
        keep((left_padded(routes, prompt_ids, completion_ids, trainer.pad_to_multiple_of), prompt_ids, completion_ids))
        return output

    return rollout


def left_padded(routes: Routes, prompt_ids: list, completion_ids: list, multiple: int | None) -> Routes:
    """Rows that start at position 0 ([N, T]) moved to the layout `generate` records in: each prompt left-padded to
    the longest (rounded up to a multiple of `multiple`), its completion after it. A row recorded past its own
    prompt + completion is a ValueError naming the row and both lengths.

    Example:
        >>> left_padded(routes_from_vllm(outputs, model), prompt_ids, completion_ids, None)  # doctest: +SKIP
    """
    from .layout import padded

    lp = [len(p) for p in prompt_ids]
    lc = [len(c) for c in completion_ids]
    P = padded(max(lp, default=0), multiple)
    N, T, L, K = routes.shape
    indices = routes.indices.new_zeros((N, P + max(lc, default=0), L, K))
    mask = routes.mask.new_zeros((N, P + max(lc, default=0)))
    for i in range(N):
        n = lp[i] + lc[i]
        if routes.mask[i, n - 1 :].any():  # (the last token is never an input: it has no route)
            raise ValueError(
                f"the rollout_func's routes record row {i} up to position {int(routes.mask[i].nonzero().max())} but it "
                f"has {lp[i]} prompt and {lc[i]} completion tokens (routes at positions 0..{n - 2})"
            )
        width = min(n, T)
        indices[i, P - lp[i] : P - lp[i] + width] = routes.indices[i, :width]
        mask[i, P - lp[i] : P - lp[i] + width] = routes.mask[i, :width]
    return Routes(indices, mask, routes.layers)
