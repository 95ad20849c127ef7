"""`record_routes`: capture the experts a model routes every token to, during `generate` or a plain forward."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn

from ...routes import LayerInfo, Routes, index_dtype
from .hub import RouterHub
from .steps import Step

# index dtype -> the tensor method that converts to it (`.byte()` parses no arguments: cheaper than `.to(dtype)`)
_NARROW = MappingProxyType(
    {torch.uint8: torch.Tensor.byte, torch.int16: torch.Tensor.short, torch.int32: torch.Tensor.int}
)


@dataclass
class _Stream:
    """Routes of one sequence batch: the steps (prefill, then one per decode step), each layer's indices and the
    padding masks."""

    batch: int
    steps: list[Step] = field(default_factory=list)
    per_step: list[dict[str, torch.Tensor]] = field(default_factory=list)  # [step][layer name] -> [B*t, K] or [B, t, K]
    masks: list[torch.Tensor] = field(default_factory=list)  # bool [B, t] pieces covering the steps from position 0
    # decode steps of a generate whose padding is read once, from the latest of their masks (each step's mask is the
    # whole generation's so far): (start, end, that mask or None if they had none, device)
    tail: tuple[int, int, torch.Tensor | None, torch.device] | None = None
    final_len: int | None = None
    ended: torch.Tensor | None = None  # bool [B, T_total]: prompt padding, or at/after a row's EOS (generate)

    def add_mask(self, step: Step) -> None:
        """Keep `step`'s padding: copied now (the caller may reuse its mask buffer), except for a decode step of
        `generate`, whose mask `generate` makes afresh each step and only extends: the latest one is kept, and read
        when the generation ends (no tensor op per step)."""
        mask, end = step.attention, step.start + step.length
        if step.generating and step.start > 0 and (mask is None or mask.shape[1] == end):
            tail = self.tail
            if tail is not None and tail[1] == step.start and (tail[2] is None) == (mask is None):
                start = tail[0]  # the pending run goes on
            else:
                self.flush()
                start = step.start
            self.tail = (start, end, mask, step.device)
            if len(self.steps) > 1:  # every recorder has read the step before: only the latest mask is held
                self.steps[-2].attention = None
            return
        self.flush()
        self.masks.append(step.real)

    def flush(self) -> None:
        """Copy the pending decode steps' padding out of the latest mask (and let go of it)."""
        if self.tail is not None:
            start, end, mask, device = self.tail
            if mask is None:
                self.masks.append(torch.ones(self.batch, end - start, dtype=torch.bool, device=device))
            else:
                self.masks.append(mask[:, start:end].to(torch.bool, copy=True))
            self.tail = None


def _joined(pieces: list[torch.Tensor], steps: list[Step], batch: int) -> torch.Tensor:
    """One layer's indices [B, T, K] from its per-step pieces (the router's own shape): each run of one-position steps
    with [B, K] pieces (decode steps) is stacked by one op, other pieces are reshaped to [B, t, K]."""
    parts: list[torch.Tensor] = []
    run: list[torch.Tensor] = []
    for piece, step in zip(pieces, steps, strict=True):
        if step.length == 1 and piece.dim() == 2 and piece.shape[0] == batch:
            run.append(piece)
            continue
        if run:
            parts.append(torch.stack(run, 1))
            run = []
        parts.append(piece.reshape(batch, step.length, piece.shape[-1]))
    if run:
        parts.append(torch.stack(run, 1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


class RouteRecorder:
    """Context manager returned by `record_routes`; `.routes` holds what was recorded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._hub: RouterHub | None = None
        self._streams: dict[int, _Stream] = {}
        self._experts: dict[str, int] = {}  # layer name -> E, in the order the layers first ran

    # ---- context -----------------------------------------------------------------------------------------------
    def __enter__(self) -> RouteRecorder:
        if self._hub is not None:
            raise RuntimeError("this recorder is already active")
        self._streams, self._experts = {}, {}
        self._hub = RouterHub.attach(self.model, self, replay=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hub is not None:
            self._hub.detach(self)
            self._hub = None

    # ---- called by the hub -----------------------------------------------------------------------------------------
    def record(self, layer: str, step: Step, indices: torch.Tensor, num_experts: int) -> None:
        stream = self._streams.get(step.stream)
        if stream is None:
            stream = self._streams[step.stream] = _Stream(step.batch)
        if not stream.steps or stream.steps[-1] is not step:
            stream.steps.append(step)
            stream.per_step.append({})
            stream.add_mask(step)
        known = self._experts.setdefault(layer, num_experts)
        if known != num_experts:
            raise ValueError(f"router {layer!r} changed from E={known} to E={num_experts}")
        dtype = index_dtype(num_experts)  # a copy either way: the model may change its tensor later
        stream.per_step[-1][layer] = indices.clone() if indices.dtype == dtype else _NARROW[dtype](indices)

    def on_generate(
        self, streams: Iterable[int], sequences: torch.Tensor, eos: list[int], prompt_mask: torch.Tensor | None
    ) -> None:
        """After a `generate`: routes span `out.sequences`, end at each row's end-of-sequence token, and are not
        recorded where the prompt's attention mask is 0 (whatever mask the cache implementation passed the forward)."""
        for sid in streams:
            stream = self._streams.get(sid)
            if stream is None:
                continue
            stream.flush()  # generate's own masks are let go
            stream.final_len = sequences.shape[1]
            # With synced_gpus a rank whose rows all finished keeps running dummy forwards (from the last token on)
            # to stay in step with the others: they are not part of out.sequences.
            kept = [k for k, step in enumerate(stream.steps) if k == 0 or step.start < stream.final_len - 1]
            stream.steps = [stream.steps[k] for k in kept]
            stream.per_step = [stream.per_step[k] for k in kept]
            prompt = stream.steps[0].length
            ended = torch.zeros(sequences.shape, dtype=torch.bool, device=sequences.device)
            if eos:
                is_eos = torch.isin(sequences[:, prompt:], torch.tensor(eos, device=sequences.device))
                ended[:, prompt:] = (
                    is_eos.cumsum(1) > 0
                )  # the EOS token itself is fed only as padding for finished rows
            if prompt_mask is not None and prompt_mask.dim() == 2 and prompt_mask.shape[1] == prompt:
                rows = sequences.shape[0] // prompt_mask.shape[0]  # num_return_sequences repeats each prompt
                if rows * prompt_mask.shape[0] == sequences.shape[0]:
                    pad = prompt_mask.to(sequences.device).repeat_interleave(rows, 0) == 0
                    ended[:, :prompt] |= pad
            stream.ended = ended

    # ---- results -------------------------------------------------------------------------------------------------
    @property
    def batches(self) -> list[Routes]:
        """One `Routes` per recorded batch (each `generate` call or plain forward starts one)."""
        return [self._build(s) for _, s in sorted(self._streams.items())]

    @property
    def routes(self) -> Routes:
        """Everything recorded, as one `Routes` (several batches are concatenated, shorter ones right-padded)."""
        batches = self.batches
        if not batches:
            raise ValueError("nothing was recorded: run a forward or generate inside `with record_routes(model)`")
        return batches[0] if len(batches) == 1 else Routes.cat(batches)

    def _build(self, stream: _Stream) -> Routes:
        """The stream's `Routes`: its steps cover positions [0, end) one after another (a stream starts at 0 and each
        forward continues where the last ended), so each layer's steps are joined by a few ops (`_joined`), not placed
        one by one (a generate has a step per new token)."""
        stream.flush()
        steps, rows = stream.steps, stream.per_step
        end = 0
        for step in steps:
            if step.start != end:
                raise RuntimeError(f"internal: a recorded step starts at {step.start}, after positions 0..{end - 1}")
            end += step.length
        T = max(end, stream.final_len or 0)
        ks = {idx.shape[-1] for row in rows for idx in row.values()}
        if len(ks) != 1:
            raise ValueError(f"layers recorded different top-k values {sorted(ks)}; Routes needs one K")
        (K,) = ks
        layers = [LayerInfo(name, E, K) for name, E in self._experts.items()]
        for step, row in zip(steps, rows, strict=True):
            if len(row) != len(layers):
                missing = [layer.name for layer in layers if layer.name not in row]
                raise ValueError(
                    f"routers {missing} recorded nothing at positions {step.start}..{step.start + step.length}"
                )
        dtype = index_dtype(max(layer.num_experts for layer in layers))
        B = stream.batch
        indices = torch.stack([_joined([r[layer.name] for r in rows], steps, B).to(dtype) for layer in layers], 2)
        mask = torch.cat(stream.masks, 1)[:, :end].to(indices.device)  # a new tensor: `&=` below leaves the pieces
        if T > end:  # the last sampled token of a generate is never forwarded
            indices = torch.cat([indices, indices.new_zeros(stream.batch, T - end, *indices.shape[2:])], 1)
            mask = torch.cat([mask, mask.new_zeros(stream.batch, T - end)], 1)
        if stream.ended is not None:
            mask &= ~stream.ended.to(mask.device)[:, :T]
        return Routes._trusted(indices, mask, tuple(layers))


def record_routes(model: nn.Module) -> RouteRecorder:
    """Record the experts every router of `model` selects, for every token it processes, while the context is open.

    Works under `generate` with a KV cache (prefill, then one position per step), with left padding,
    `num_return_sequences`, and with plain forwards; routes land at the positions of `out.sequences`, with padding
    and the last sampled token masked out. Recomputes under gradient checkpointing are not recorded twice.

    Example:
        >>> with record_routes(model) as rec:  # doctest: +SKIP
        ...     out = model.generate(**batch, do_sample=True, return_dict_in_generate=True)
        >>> routes = rec.routes  # [B, T, L, K], aligned to out.sequences
    """
    return RouteRecorder(model)
