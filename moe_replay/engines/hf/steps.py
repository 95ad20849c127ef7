"""Which sequence positions a forward call covers (prefill [B, T_prompt], then [B, 1] per decode step), and the
wrapper that makes each outermost forward of a tracked model a step (of its session's `StepTracker`, tracker.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ForeignThreadError
from ..autograd import in_backward, inside_reentrant_checkpoint

HAND_OVER = 32  # decode steps of a generate held before the recorders take them (`Session.step_ended`)


@dataclass(slots=True)
class Step:
    """One top-level forward: `batch` rows at positions [start, start + length) of stream `stream`; `grad`: True if
    grad was enabled as it began, else None until a replayed router call asks if a reentrant checkpoint surrounds it."""

    stream: int
    batch: int
    start: int
    length: int
    attention: torch.Tensor | None  # the forward's own mask [B, >= length] if any (a decode step's: all so far)
    device: torch.device
    grad: bool | None = None
    synced: bool = False  # inside generate(synced_gpus=True)
    generating: bool = False  # inside generate
    _real: torch.Tensor | None = field(default=None, repr=False)
    _masked: bool = field(default=False, repr=False)  # (once `real` is made: whether it came from a mask)
    tokens: int = field(init=False)  # batch * length

    def __post_init__(self) -> None:
        self.tokens = self.batch * self.length

    @property
    def has_mask(self) -> bool:
        """Whether the forward had its own attention mask (else every position is taken as real)."""
        return self.attention is not None if self._real is None else self._masked

    @property
    def real(self) -> torch.Tensor:
        """bool [B, length]: False at padding. Made on first use (by a recorder, or a replay's first router call) as a
        copy, so that a mask buffer the caller reuses cannot change it afterwards."""
        if self._real is None:
            mask = self.attention
            self._masked = mask is not None
            if mask is not None:  # its columns are the stream's positions; a mask made for a cache of fixed size (a
                # static cache's loop) runs past this step's end, one that covers a window only ends with it
                end = self.start + self.length
                columns = mask[:, self.start : end] if mask.shape[1] >= end else mask[:, mask.shape[1] - self.length :]
                self._real = columns.to(torch.bool, copy=True)
            else:
                self._real = torch.ones(self.batch, self.length, dtype=torch.bool, device=self.device)
            self.attention = None
        return self._real


def extends_generation(step: Step) -> bool:
    """Whether `step` is a later step of `generate` whose mask (if any) is the whole generation's so far (`add_mask`).

    Example:
        >>> extends_generation(Step(0, 1, 32, 1, None, torch.device("cpu"), generating=True))
        True
    """
    mask = step.attention
    return step.generating and step.start > 0 and (mask is None or mask.shape[1] == step.start + step.length)


def output_cache(out: Any) -> Any:
    """The KV cache a forward returned: a model output's `cache` (`past_key_values` before transformers 5), or a
    cache among a tuple's items (`return_dict=False`); None without one.

    Example:
        >>> output_cache((torch.zeros(1),)) is None
        True
    """
    if isinstance(out, dict):  # (a ModelOutput, read as the dict it is: its own `get` maps and warns of old names)
        found = dict.get(out, "cache")
        return dict.get(out, "past_key_values") if found is None else found
    if isinstance(out, tuple | list):
        return next((item for item in out if callable(getattr(item, "get_seq_length", None))), None)
    return None


def step_wrapper(hub: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
    """A tracked model's `forward`, wrapped by `hub` (hub.py): its outermost call is a step of its session's tracker.

    Example:
        >>> model.forward = step_wrapper(hub, model.forward)  # doctest: +SKIP
    """
    thread = threading.get_ident

    def forward(*args: Any, **kwargs: Any) -> Any:
        session, tracker = hub.session, hub.session.tracker
        if tracker.depth or in_backward():  # an inner model called by the outer one, or a recompute
            if tracker.depth and thread() != tracker.thread and not in_backward():  # (autograd's threads recompute)
                raise ForeignThreadError(
                    f"{type(hub.model).__name__} ran a forward in another thread while a forward of it, with "
                    "moe-replay contexts open, was running: its router calls would be placed in that forward; run the "
                    "model in one thread at a time"
                )
            return inner(*args, **kwargs)
        for replayer in session.replayers:  # (a packed row's replay refuses a forward that would mix its sequences)
            if replayer.forward_check is not None:
                replayer.forward_check(inner, args, kwargs)
        step = tracker.begin(inner, args, kwargs, session.generating > 0, session.check_resume)
        tracker.thread = thread()
        step.synced = session.synced
        if step.grad is None and session.replayers:  # began without grad: a checkpoint around the model recomputes it
            step.grad = inside_reentrant_checkpoint()  # (the stack above the model, walked once per forward)
        tracker.depth += 1
        try:
            out = inner(*args, **kwargs)
        except BaseException:
            session.step_failed(step)  # never backwarded, nor recorded
            raise
        finally:
            tracker.depth -= 1
        if tracker.cache is None:  # the cache a forward made is its stream's too (`out.cache` fed back)
            tracker.own(output_cache(out))
        session.step_ended(step)  # the recorders take its router calls, a generate's decode steps a few at a time
        return out

    return forward
