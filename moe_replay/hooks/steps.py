"""Which sequence positions a forward call covers: prefill [B, T_prompt], then [B, 1] per decode step."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Step:
    """One forward of the top-level model: `batch` rows at positions [start, start + length) of stream `stream`.

    `real` is bool [B, length]: False at padding (attention mask 0).
    """

    stream: int
    batch: int
    start: int
    length: int
    real: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.batch * self.length


class StepTracker:
    """Turns top-level forward calls into `Step`s. A forward whose KV cache already holds tokens continues the current
    stream at the next position; any other forward starts a new stream at position 0."""

    def __init__(self, model: nn.Module) -> None:
        self._signature = inspect.signature(model.forward)
        self.stream = -1
        self.cursor = 0
        self.current: Step | None = None

    def on_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get("kwargs", {}) if isinstance(bound.get("kwargs"), dict) else {}
        tokens = bound.get("input_ids")
        if tokens is None:
            tokens = bound.get("inputs_embeds", extra.get("inputs_embeds"))
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise ValueError(
                "moe-replay needs batched input_ids [B, T] or inputs_embeds [B, T, H] to place routes, got "
                f"{None if tokens is None else tuple(tokens.shape)}"
            )
        B, t = tokens.shape[0], tokens.shape[1]
        cache = None
        for key in ("cache", "past_key_values"):
            cache = bound.get(key, extra.get(key))
            if cache is not None:
                break
        continuing = cache is not None and hasattr(cache, "get_seq_length") and int(cache.get_seq_length()) > 0
        if continuing:
            if self.current is None:
                raise ValueError(
                    "a forward with a non-empty KV cache continues a generation that started before this moe-replay "
                    "context was entered: enter the context before the first (prefill) forward"
                )
            if B != self.current.batch:
                raise ValueError(f"a cached forward with batch {B} continues a stream of batch {self.current.batch}")
            start = self.cursor
        else:
            self.stream += 1
            start = 0
        self.cursor = start + t
        mask = bound.get("attention_mask", extra.get("attention_mask"))
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == B and mask.shape[1] >= t:
            real = mask[:, -t:].to(torch.bool)
        else:
            real = torch.ones(B, t, dtype=torch.bool, device=tokens.device)
        self.current = Step(self.stream, B, start, t, real)
        return self.current
