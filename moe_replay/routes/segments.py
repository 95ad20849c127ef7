"""Multi-turn and partial rollouts: assemble one conversation's routes from the forwards that produced it, each with
its policy version, and bound their age at replay.

The rule: position t's route comes from the sampler forward whose output at t the next token was sampled from; a
position whose next token was not sampled (prompt, environment or tool tokens) takes the route of the first forward
that computed it (with a KV cache kept across turns, the one whose KV the later sampled tokens attended to; without
one, turn 2 re-runs turn 1's positions and its routes there are dropped). Two forwards that both sampled from one
position with different routes are an error, never an overwrite.

Shapes: B conversations, T positions of the assembled batch, T_s of a segment's batch, L layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .core import Routes
from .index import is_integer_scalar
from .layers import layer_diff
from .packed import token_mask
from .placed import PlacedRoutes

VERSION_MAX = 2**31 - 1  # versions are stored as int32


@dataclass(frozen=True)
class Segment:
    """One sampler forward's recording within a batch of conversations (a turn, or an answer resumed after an update).

    Attributes:
        routes: [B, T_s, L, K] as recorded over the segment's own batch.
        attention_mask: [B, T_s], 1 at that batch's real tokens (its padding is skipped).
        version: the policy version whose weights ran this forward.
        sampled_from: per conversation (or one int), the conversation position from which on this forward sampled
            the next tokens: its input's length − 1 for a `generate` call.
        start: per conversation (or one int), the conversation position of the segment's first real token: 0 when the
            forward re-ran the whole conversation, the cached length when it continued a kept KV cache.

    Example:
        >>> Segment(rec.routes, batch["attention_mask"], version=3, sampled_from=prompt_lengths - 1)  # doctest: +SKIP
    """

    routes: Routes
    attention_mask: torch.Tensor
    version: int
    sampled_from: int | Sequence[int] | torch.Tensor
    start: int | Sequence[int] | torch.Tensor = 0


def assemble_routes(segments: Sequence[Segment], attention_mask: torch.Tensor) -> Routes:
    """The routes of B conversations laid out as the trainer's batch `attention_mask` [B, T] (each row's real tokens
    are its conversation's positions 0, 1, ... in order), with `version` per position, from the `segments` in the
    order they ran, by the rule of this module. Raises ValueError for segments whose versions go backwards, shapes or
    layers that disagree, a segment reaching past its conversation, or two segments that sampled from one position
    with different routes. The result is on the CPU (`.to(device)` moves it).

    Example:
        >>> routes = assemble_routes([turn1, turn2], full_batch["attention_mask"])  # doctest: +SKIP
        >>> routes.version[0, :12]  # doctest: +SKIP
    """
    segments = list(segments)
    if not segments:
        raise ValueError("assemble_routes needs at least one Segment")
    cpu = torch.device("cpu")  # (masks and offsets on any device: assembled on the CPU)
    keep = token_mask(torch.as_tensor(attention_mask), cpu)
    B, T = keep.shape
    for s, seg in enumerate(segments):
        _check(seg, s, segments, B)
    first = segments[0].routes
    lengths = keep.sum(1)
    rows, cols = keep.nonzero(as_tuple=True)
    column = torch.full((B, int(lengths.max()) if B else 0), -1, dtype=torch.long)  # conversation position -> column
    column[rows, keep.long().cumsum(1)[rows, cols] - 1] = cols
    L, K = first.shape[2:]
    indices = torch.zeros((B, T, L, K), dtype=first.indices.dtype)  # (assembled on the CPU)
    mask = torch.zeros((B, T), dtype=torch.bool)
    version = torch.zeros((B, T), dtype=torch.int32)
    claimed = torch.full((B, T), -1)  # the segment that sampled from a position (-1: none)
    for s, seg in enumerate(segments):
        start = _per_row(seg.start, B, "start", s)
        sampled_from = _per_row(seg.sampled_from, B, "sampled_from", s)
        real = token_mask(seg.attention_mask, cpu)
        stray = seg.routes.mask.cpu() & ~real
        if stray.any():  # (a left-padded turn given a right-padded mask: its routes would land `pad` positions off)
            i, t = (int(x) for x in stray.nonzero()[0])
            raise ValueError(
                f"segment {s}, conversation {i}: a route is recorded at position {t} of the segment's batch, which "
                "its attention_mask marks padding: the mask is not the one of the forward that recorded the routes"
            )
        conv = real.long().cumsum(1) - 1 + start[:, None]  # each real token's conversation position
        beyond = real & (conv >= lengths[:, None])
        if beyond.any():
            i = int(beyond.nonzero()[0, 0])
            raise ValueError(
                f"segment {s}, conversation {i}: it reaches position {int(conv[i][real[i]].max())} but the assembled "
                f"batch holds {int(lengths[i])} tokens of it"
            )
        b, t = seg.routes.mask.cpu().nonzero(as_tuple=True)  # (CPU index tensors from here on)
        p = conv[b, t]
        d, sampled = column[b, p], p >= sampled_from[b]
        held = claimed[b, d] >= 0
        clash = (sampled & held).nonzero().squeeze(1)
        if len(clash):  # (sets: the K order does not matter)
            mine = seg.routes.indices[b[clash], t[clash]].cpu()
            differ = (indices[b[clash], d[clash]].sort(-1).values != mine.sort(-1).values).flatten(1).any(1)
            if differ.any():
                j = int(differ.nonzero()[0])
                i, q = int(b[clash[j]]), int(d[clash[j]])
                raise ValueError(
                    f"conversation {i}, position {int(p[clash[j]])}: segments {int(claimed[i, q])} and {s} both "
                    f"sampled from it, with different routes ({indices[i, q].tolist()} vs {mine[j].tolist()})"
                )
        take = (sampled & ~held) | (~sampled & ~held & ~mask[b, d])
        b, t, d = b[take], t[take], d[take]
        src = _flat(seg.routes.indices)
        rows = src.index_select(0, (b * seg.routes.seq_len + t).to(src.device)).cpu()
        _flat(indices).index_copy_(0, b * T + d, rows)
        mask[b, d] = True
        version[b, d] = int(seg.version)
        claimed[b[sampled[take]], d[sampled[take]]] = s
    return Routes._trusted(indices, mask, first.layers, version)  # (ids from valid Routes; versions ints >= 0)


def _flat(indices: torch.Tensor) -> torch.Tensor:
    """[B, T, L, K] ids as one row of L x K per position, in 8-byte words where the row allows (copying whole rows
    by index then moves words, not bytes: about 3x faster)."""
    rows = indices.reshape(-1, indices.shape[2] * indices.shape[3])
    return rows.view(torch.int64) if (rows.shape[1] * rows.element_size()) % 8 == 0 else rows


def _is_count(value: object) -> bool:
    """Whether `value` is a whole number >= 0 (an int, a numpy integer or a 0-d integer tensor; a policy version or an
    age; a bool is not one)."""
    return is_integer_scalar(value) and int(value) >= 0


def _per_row(value: int | Sequence[int] | torch.Tensor, B: int, name: str, s: int) -> torch.Tensor:
    """`value` (one whole number >= 0, or one per conversation) as a long CPU tensor [B]; a float is refused, never
    truncated."""
    wrong = ValueError(
        f"segment {s}: {name} must be one whole number >= 0 or one per conversation (B={B}), got {value!r}"
    )
    try:
        given = torch.as_tensor(value).cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise wrong from e
    if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise wrong
    out = given.long()
    if out.dim() == 0:
        out = out.expand(B)
    if out.shape != (B,) or (out < 0).any():
        raise wrong
    return out


def _check(seg: Segment, s: int, segments: list[Segment], B: int) -> None:
    """One segment against the batch and the segments before it; ValueError naming both sides."""
    if not isinstance(seg, Segment) or not isinstance(seg.routes, Routes):
        raise ValueError(f"segment {s} must be a Segment holding Routes, got {type(seg).__name__}")
    if seg.routes.layers != segments[0].routes.layers:
        raise ValueError(
            f"segment {s} covers other layers than segment 0: "
            f"{layer_diff(segments[0].routes.layers, seg.routes.layers)}"
        )
    if seg.routes.batch_size != B or tuple(seg.attention_mask.shape) != seg.routes.shape[:2]:
        raise ValueError(
            f"segment {s}: routes are B={seg.routes.batch_size}, T={seg.routes.seq_len} and its attention_mask "
            f"{tuple(seg.attention_mask.shape)}, but the assembled batch has B={B} conversations"
        )
    if not _is_count(seg.version) or int(seg.version) > VERSION_MAX:
        raise ValueError(
            f"segment {s}: version must be a whole number from 0 to {VERSION_MAX} (a policy version), "
            f"got {seg.version!r}"
        )
    if s and seg.version < segments[s - 1].version:
        raise ValueError(
            f"segment {s} has version {seg.version} after segment {s - 1}'s {segments[s - 1].version}: versions "
            "cannot go backwards within a conversation"
        )


def fresh(routes: Routes, current: int, max_age: int) -> Routes:
    """`routes` with only the positions produced at most `max_age` versions before `current` still recorded: a
    replay then routes the older ones live (a staleness bound; off unless you call it). Needs `routes.version`.
    Packed or context-parallel routes keep their place (`PlacedRoutes`).

    Example:
        >>> with replay_routes(model, fresh(routes, current=step, max_age=2)):  # doctest: +SKIP
        ...     logits = model(input_ids).logits
    """
    if routes.version is None:
        raise ValueError("fresh needs routes with versions (assemble_routes gives them); these have none")
    for name, value in (("current", current), ("max_age", max_age)):
        if not _is_count(value):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    version, current, max_age = routes.version.long(), int(current), int(max_age)  # (int64: no int32 wrap)
    ahead = routes.mask & (version > current)
    if ahead.any():
        b, t = (int(x) for x in ahead.nonzero()[0])
        raise ValueError(f"sequence {b}, position {t} has version {int(version[b, t])}, newer than current={current}")
    mask = routes.mask & (current - version <= max_age)
    kept = Routes._trusted(routes.indices, mask, routes.layers, routes.version)
    return type(routes).placed(kept, **routes.place()) if isinstance(routes, PlacedRoutes) else kept
