"""`StepTracker`: which stream and positions each outermost forward of a hooked model covers (a `Step`, steps.py): one
whose KV cache holds the current stream's tokens continues that stream; any other starts a new one at position 0."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ...errors import UnsupportedGenerationError
from .steps import Step

GENERATE_START = object()  # `StepTracker.cache` as a generate begins, before its first step


class StepTracker:
    """Turns outermost forward calls into `Step`s (see the module docstring)."""

    __slots__ = (
        "stream", "cursor", "batch", "current", "depth", "cache", "resumed", "thread", "_owners", "_signatures",
    )  # fmt: skip

    def __init__(self, signatures: dict | None = None) -> None:
        self.stream, self.cursor, self.batch, self.depth = -1, 0, 0, 0
        self.current: Step | None = None
        # the KV cache of the running generate's last step, holding its tokens (`begin`); GENERATE_START before its
        # first step; None between generate calls (one left may be emptied before the next; the hub keeps none alive)
        self.cache: Any = None
        # the stream the running generate continues through its kept KV cache, and what its first forward's mask says
        # of the positions before it (False: padding to this turn; None: no mask)
        self.resumed: tuple[int, torch.Tensor | None] | None = None
        self.thread = 0  # the thread running the current step (`step_wrapper`)
        # id(KV cache) -> (a weak reference to it, the stream whose forwards last used or returned it) (`own`)
        self._owners: dict[int, tuple[weakref.ref, int]] = {}
        # per forward function: (its signature, positional parameter names) (a dict the caller may keep across
        # trackers, e.g. on the model: inspecting a signature costs more than a whole router call)
        self._signatures: dict[Any, tuple] = {} if signatures is None else signatures

    def begin(
        self, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any], generating: bool = False,
        on_resume: Callable[[int], None] | None = None,
    ) -> Step:  # fmt: skip
        """Open the step of an outermost forward (`forward`: the module's unwrapped one; `generating`: in `generate`).
        `on_resume(stream)`, called first if it opens a generate continuing `stream`'s kept cache, may raise."""
        if not args:  # the keyword arguments are the call's arguments as they are
            bound = kwargs
        else:  # positional arguments onto the leading positional parameters' names (cached per forward)
            sig, names = self._signatures.get(forward) or self._signature(forward)
            if names is not None and len(args) <= len(names):
                bound = dict(zip(names, args, strict=False))
                if kwargs:
                    bound.update(kwargs)
            else:  # a signature with *args, or more positional arguments than parameters: bound by `inspect`
                bound = bind(sig, args, kwargs)
        tokens = next((bound[n] for n in ("input_ids", "inputs_embeds") if bound.get(n) is not None), None)
        if tokens is None:
            tokens = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise ValueError(
                "moe-replay needs batched input_ids [B, T] or inputs_embeds [B, T, H] to place routes, got "
                f"{None if tokens is None else tuple(tokens.shape)}"
            )
        B, t = tokens.shape[:2]
        cache = next((bound[n] for n in ("cache", "past_key_values") if bound.get(n) is not None), None)
        noted = True  # whether the cache is noted as this step's stream's (`own`) already, or there is none
        resuming = False  # the first step of a generate continuing the kept cache of the current stream
        length = getattr(cache, "get_seq_length", None)
        if cache is None:
            continuing = False
        elif generating and cache is self.cache:  # a later step of this generate: its cache holds the steps before
            continuing = True
            if length is not None and self.cursor > 0 and int(length()) == 0:
                raise UnsupportedGenerationError(
                    f"generate's KV cache is still empty after forwards of {self.cursor} positions: the model ran "
                    "without it (transformers 5.19 turns the cache off in training mode with gradient "
                    "checkpointing), so each step saw only its own tokens and its routes belong to no real "
                    "generation; generate in eval mode (model.eval()) or with gradient checkpointing off"
                )
        else:
            noted = False
            held = int(length()) if length is not None else 0
            continuing = held > 0
            owner = self._owners.get(id(cache))
            if continuing and generating and self.cache is GENERATE_START:  # the first step of a generate
                if owner is None or owner[0]() is not cache or owner[1] != self.stream or held != self.cursor:
                    raise UnsupportedGenerationError(
                        f"generate was given a KV cache that already holds {held} tokens, not the one the last "
                        "generate or forward inside this context left (copied, cropped, another batch's, or filled "
                        "before the context): its routes could not be lined up with out.sequences; pass each "
                        "generate a fresh cache (or none), or, for a conversation over one kept cache, open the "
                        "context before its first turn and pass each turn the cache the turn before left"
                    )
                resuming = True  # a later turn of one conversation: its routes continue the stream
                if on_resume is not None:
                    on_resume(self.stream)
            if continuing and owner is not None and owner[0]() is cache and owner[1] != self.stream:
                raise ValueError(
                    f"a forward continues a KV cache ({held} tokens) of an earlier batch after another batch began "
                    f"(the current one: {self.batch} rows at position {self.cursor}): routes are placed one batch "
                    "after another, so interleaved caches cannot be placed; finish one batch's forwards before the "
                    "next batch's first, or open a context per batch"
                )
            if continuing and self.stream >= 0 and held != self.cursor:  # (a stream's positions are its forwards')
                raise ValueError(
                    f"a forward continues a KV cache that holds {held} tokens, but the stream it would continue ends "
                    f"at position {self.cursor}: a cache copied, cropped or rolled back, or another stream's, cannot "
                    "be placed; open a context per continuation of one cache (prefill included), or run the "
                    "continuations without a cache"
                )
        if continuing:
            if self.stream < 0:
                raise ValueError(
                    "a forward with a non-empty KV cache continues a generation that started before this moe-replay "
                    "context was entered: enter the context before the first (prefill) forward"
                )
            if B != self.batch:
                raise ValueError(f"a cached forward with batch {B} continues a stream of batch {self.batch}")
            start = self.cursor
        else:
            self.stream, start = self.stream + 1, 0
        self.cursor, self.batch = start + t, B
        self.cache = cache if generating and t > 0 else None
        if not noted:
            self.own(cache)
        mask = bound.get("attention_mask")  # sliced to the step's columns only if a recorder asks (`Step.real`)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] < t:
            mask = None
        if resuming:
            before = mask[:, :start] != 0 if mask is not None and mask.shape[1] >= start + t else None
            self.resumed = (self.stream, before)
        grad = True if torch.is_grad_enabled() else None
        self.current = Step(self.stream, B, start, t, mask, tokens.device, grad, False, generating)  # (positional)
        return self.current

    def own(self, cache: Any) -> None:
        """Note `cache` as the current stream's (`begin` refuses another stream continuing it); a legacy tuple isn't."""
        key, owners = id(cache), self._owners
        entry = owners.get(key)
        if cache is None or (entry is not None and entry[0]() is cache and entry[1] == self.stream):
            return
        try:  # (forgotten as the cache is freed: the hub never keeps a cache alive)
            owners[key] = (weakref.ref(cache, partial(_forget, owners, key)), self.stream)
        except TypeError:
            pass

    def positional(self, func: Any) -> tuple[str, ...] | None:
        """The names of `func`'s leading positional parameters (None: *args or no signature), parsed once per func."""
        try:
            return (self._signatures.get(func) or self._signature(func))[1]
        except (TypeError, ValueError):
            return None

    def _signature(self, forward: Any) -> tuple[inspect.Signature, tuple[str, ...] | None]:
        sig = inspect.signature(forward)
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = list(sig.parameters.values())
        plain = all(p.kind != inspect.Parameter.VAR_POSITIONAL for p in params)
        found = self._signatures[forward] = (sig, tuple(p.name for p in params if p.kind in kinds) if plain else None)
        return found


def _forget(owners: dict, key: int, ref: weakref.ref) -> None:
    if key in owners and owners[key][0] is ref:
        del owners[key]


def bind(sig: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by parameter name (`sig`: its function's), a `**kwargs` parameter's flattened among them.

    Example:
        >>> bind(inspect.signature(lambda a, **kw: None), (1,), {"b": 2})
        {'a': 1, 'b': 2}
    """
    bound = dict(sig.bind_partial(*args, **kwargs).arguments)
    for p in sig.parameters.values():
        if p.kind == inspect.Parameter.VAR_KEYWORD and p.name in bound:
            bound.update(bound.pop(p.name))
    return bound
