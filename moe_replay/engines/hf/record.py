"""`record_routes`: capture the experts a model routes every token to, during `generate` or a plain forward."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...routes import LayerInfo, Routes, index_dtype
from .hub import RouterHub
from .steps import Step
from .stream import Stream, Taken

PLAIN_FILLED = (
    "the cache was filled by a plain forward, not a generate: continue a kept cache from generate to generate"
)


class RouteRecorder:
    """Context manager returned by `record_routes`; `.routes` holds what was recorded."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._hub: RouterHub | None = None
        self._streams: dict[int, Stream] = {}
        self._experts: dict[str, int] = {}  # layer name -> E, in the order the layers first ran
        self._checked: tuple[tuple, tuple] = ((), ())  # (layer names, E of each) of a step found to match `_experts`

    def __enter__(self) -> RouteRecorder:
        if self._hub is not None:
            raise RuntimeError("this recorder is already active")
        self._streams, self._experts, self._checked = {}, {}, ((), ())
        self._hub = RouterHub.attach(self.model, self, replay=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hub is not None:
            self._hub.detach(self)
            self._hub = None

    def record_step(self, step: Step, taken: list[Taken]) -> None:
        """Keep the router calls of `step` (handed over by the hub when the step's forward returns)."""
        if (stream := self._streams.get(step.stream)) is None:
            stream = self._streams[step.stream] = Stream(step.batch)
        names, indices, versions, sizes = zip(*taken, strict=True)
        if (names, sizes) != self._checked:  # (a decode step's are the step before's)
            for name, size in zip(names, sizes, strict=True):
                if (known := self._experts.setdefault(name, size)) != size:
                    raise ValueError(f"router {name!r} changed from E={known} to E={size}")
            self._checked = (names, sizes)
        stream.take(step, names, indices, versions, self._experts)

    def drop_streams(self, first: int) -> None:
        """Forget the streams `first` and after (those of a `generate` that raised)."""
        self._streams = {sid: s for sid, s in self._streams.items() if sid < first}

    def check_resume(self, stream: int) -> None:
        """Raise (at the first forward of a `generate` that continues `stream`'s kept KV cache) unless this recorder
        holds that stream's last generate: else the whole generation would run before `on_generate` found out."""
        if (known := self._streams.get(stream)) is None:
            raise ValueError(
                "a generate continues a kept KV cache whose earlier turns ran before this record_routes context was "
                "opened: the routes of those turns' positions are not here to line the new ones up with; open the "
                "context before the conversation's first turn"
            )
        if known.sequences is None:
            raise ValueError(f"a generate continued a kept KV cache, but {PLAIN_FILLED}")

    def on_generate(
        self, streams: Iterable[int], sequences: torch.Tensor, eos: list[int], prompt_mask: torch.Tensor | None,
        prompt: int | None = None, resumed: tuple[int, torch.Tensor | None] | None = None,
    ) -> None:  # fmt: skip
        """After a `generate`: routes span `out.sequences`, end at each row's EOS after the prompt (`prompt` tokens;
        None: its first forward's, which a chunked prefill splits), masked where the prompt's attention mask is 0. A
        generate that continued stream `resumed[0]`'s kept cache must start with its last `out.sequences`; earlier
        turns' positions stay where its first forward's mask (`resumed[1]`) attends to them."""
        for sid in streams:
            if (stream := self._streams.get(sid)) is None:
                continue
            if resumed is not None and resumed[0] == sid:
                continues(stream, sequences)
            stream.sequences = sequences.clone()
            stream.flush_masks()  # generate's own masks are let go
            stream.final_len = sequences.shape[1]
            # with synced_gpus a rank whose rows all finished runs dummy forwards (from the last token on): dropped
            stream.end = next((s.start for s in stream.steps[1:] if s.start >= stream.final_len - 1), None)
            prompt, keep = (stream.steps[0].length if prompt is None else prompt), []
            if eos:  # not at or after a row's EOS (the EOS token itself is fed only as padding for finished rows)
                new = sequences[:, prompt:]
                hit = new == eos[0] if len(eos) == 1 else torch.isin(new, torch.tensor(eos, device=new.device))
                keep.append((prompt, hit.cumsum(1) == 0))
            if prompt_mask is not None and prompt_mask.dim() == 2 and prompt_mask.shape[1] == prompt:
                rows = sequences.shape[0] // prompt_mask.shape[0]  # num_return_sequences repeats each prompt
                if rows * prompt_mask.shape[0] == sequences.shape[0]:
                    real = prompt_mask != 0
                    keep.append((0, real if rows == 1 else real.repeat_interleave(rows, 0)))
            if resumed is not None and resumed[0] == sid and resumed[1] is not None:
                keep.append((0, resumed[1]))
            stream.keep = keep

    @property
    def batches(self) -> list[Routes]:
        """One `Routes` per recorded batch (each `generate` call or plain forward starts one)."""
        if self._hub is not None:  # read inside the context: the steps the hub still holds first
            self._hub.session.hand_over()
        return [self._build(s) for _, s in sorted(self._streams.items())]

    @property
    def routes(self) -> Routes:
        """Everything recorded, as one `Routes` (several batches are concatenated, shorter ones right-padded)."""
        batches = self.batches
        if not batches:
            raise ValueError("nothing was recorded: run a forward or generate inside `with record_routes(model)`")
        return batches[0] if len(batches) == 1 else Routes.cat(batches)

    def _build(self, stream: Stream) -> Routes:
        """The stream's `Routes`, over the positions [0, end) its steps cover one after another."""
        indices, mask = stream.indices(list(self._experts), self._experts, stream.final_len or 0)
        layers = tuple(LayerInfo(name, E, indices.shape[-1]) for name, E in self._experts.items())
        indices, mask = indices.to(index_dtype(max(self._experts.values()))), mask.to(indices.device)
        for start, kept in stream.keep:  # (a few ops: this runs per generate)
            part = mask[:, start : start + kept.shape[1]]
            part &= kept[:, : part.shape[1]].to(part.device)
        return Routes._trusted(indices, mask, layers)


def continues(stream: Stream, sequences: torch.Tensor) -> None:
    """Raise (and keep as the stream's problem) unless a generate that continued `stream`'s kept KV cache starts its
    `sequences` with the stream's last `out.sequences`, row by row (else its routes would land on other tokens)."""
    last, problem = stream.sequences, None
    if last is None:
        problem = PLAIN_FILLED
    elif sequences.shape[0] != last.shape[0] or sequences.shape[1] < last.shape[1]:
        problem = (
            f"it returned {tuple(sequences.shape)} but the last generate's out.sequences are {tuple(last.shape)}: "
            "continue a kept cache with the same rows"
        )
    elif (differ := sequences[:, : last.shape[1]] != last.to(sequences.device)).any():
        row, col = (int(x) for x in differ.nonzero()[0])
        problem = (
            f"its row {row} differs at position {col} from the tokens the cache holds (the last generate's "
            "out.sequences): a cache reordered or a history edited would put routes on other tokens; give each "
            "turn the last turn's out.sequences + the new tokens, rows in order"
        )
    if problem is not None:
        stream.problem = ValueError(f"a generate continued a kept KV cache, but {problem}")
        raise stream.problem


def record_routes(model: nn.Module) -> RouteRecorder:
    """Record the experts every router of `model` selects, for every token it processes, while the context is open.

    Works under `generate` with a KV cache (prefill, then one position per step), left padding, `num_return_sequences`,
    and with plain forwards; routes land at the positions of `out.sequences`, with padding and the last sampled token
    masked out. A conversation whose turns each continue the KV cache the turn before left (`generate(cache=cache)`, all
    inside the context) is one batch: its routes span the last turn's `out.sequences`, each position routed by the
    forward that put it in the cache. Recomputes under gradient checkpointing are not recorded twice.

    Example:
        >>> with record_routes(model) as rec:  # doctest: +SKIP
        ...     out = model.generate(**batch, do_sample=True, return_dict_in_generate=True)
        >>> routes = rec.routes  # [B, T, L, K], aligned to out.sequences
    """
    return RouteRecorder(model)
