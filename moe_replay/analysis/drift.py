"""Routing drift of a live model: after an optimizer update, and between two ways of running the same policy."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..engines.hf import record_routes
from ..engines.hf.hub import open_contexts
from ..errors import ReplayError
from ..routes import Routes
from .metrics import ExpertChange, expert_change


def teacher_forced_routes(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
) -> Routes:
    """Record the live routes of one no-grad teacher-forced forward over `sequences` [B, T], in eval mode (no dropout
    or router noise; each module's mode is restored). Raises `ReplayError` inside an open `replay_routes` on the model,
    where it would record the replayed experts, and inside an open `record_routes`, which would record its forward as
    a batch of its own.

    Example:
        >>> routes = teacher_forced_routes(model, out.sequences, mask)  # doctest: +SKIP
    """
    recording, replaying = open_contexts(model)
    if recording and not replaying:
        raise ReplayError(
            f"teacher_forced_routes runs a forward of {type(model).__name__}, but a record_routes context is open on "
            "it, which would record that forward as a batch of its own: call it (or measure_update_drift / "
            "measure_mismatch) outside the recording"
        )
    if replaying:
        raise ReplayError(
            f"teacher_forced_routes records {type(model).__name__}'s live routes, but a replay_routes context is open "
            "on it, so it would record the replayed experts: call it (or measure_update_drift / measure_mismatch) "
            "outside the replay, e.g. after loss.backward()"
        )
    modes = [(m, m.training) for m in model.modules()]  # (train(mode) would set every submodule to one mode)
    model.eval()
    try:
        with torch.no_grad(), record_routes(model) as rec:
            model(sequences, attention_mask=attention_mask, position_ids=position_ids)
    finally:
        for module, mode in modes:
            module.training = mode
    return rec.routes


def measure_update_drift(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    update: Callable[[], object],
    position_ids: torch.Tensor | None = None,
) -> ExpertChange:
    """How many routed experts an update moves: teacher-forced routes on the same tokens before and after `update()`.

    Example:
        >>> loss.backward()  # doctest: +SKIP
        >>> drift = measure_update_drift(model, seq, mask, update=lambda: opt.step())  # doctest: +SKIP
        >>> drift.fraction  # doctest: +SKIP
    """
    before = teacher_forced_routes(model, sequences, attention_mask, position_ids=position_ids)
    update()
    after = teacher_forced_routes(model, sequences, attention_mask, position_ids=position_ids)
    return expert_change(before, after, label="before vs after one update")


def measure_mismatch(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor | None,
    routes: Routes,
    *,
    position_ids: torch.Tensor | None = None,
    label: str = "rollout vs trainer",
) -> ExpertChange:
    """Training/inference routing mismatch: `routes` recorded elsewhere (during `generate`, by another engine, in
    another precision) against a teacher-forced forward of `model` on the same `sequences`. Routes recorded where
    `attention_mask` is 0 (padding) are refused: they were placed in another layout.

    Example:
        >>> with record_routes(sampler) as rec:  # doctest: +SKIP
        ...     out = sampler.generate(**batch, do_sample=True, return_dict_in_generate=True)
        >>> measure_mismatch(trainer, out.sequences, mask, rec.routes).fraction  # doctest: +SKIP
    """
    if attention_mask is not None and tuple(attention_mask.shape) == tuple(routes.mask.shape):
        padding = routes.mask & (attention_mask.to(routes.mask.device) == 0)
        if bool(padding.any()):
            i, t = (int(v) for v in padding.nonzero()[0])
            raise ValueError(
                f"routes are recorded at {int(padding.sum())} positions the attention mask leaves out (first: row "
                f"{i}, position {t}): routes imported without the batch's left padding (`pad_left`) land there; or "
                "drop those positions first (routes.mask & attention_mask)"
            )
    trainer = teacher_forced_routes(model, sequences, attention_mask, position_ids=position_ids)
    return expert_change(routes, trainer, label=label)
