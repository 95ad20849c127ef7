"""What a recorder holds of one recorded batch (a prefill, then one step per new token): each step's padding, and its
router calls' top-k indices as the routers returned them, copied into the routes' narrow dtype many at a time (a step
of several positions at its end, decode steps `HOLD` at a time) by one stack and one conversion."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import UnsupportedModelError
from ...routes import index_dtype
from ..autograd import version, versions
from .steps import Step, extends_generation

HOLD = 32  # decode steps held before their indices are copied (int64 [B, K] per layer each, as the routers made them)


# One router call of a step, as the hub hands it over: (its layer name, its top-k indices as they were selected, their
# version counter then (None: an inference tensor, copied already), E) (`hold`). A plain tuple: one per router call.
Taken = tuple[str, torch.Tensor, int | None, int]


@dataclass
class Block:
    """Consecutive steps of a stream from position `start`: `indices` [B, t, L, K] of layers `names` (call order)."""

    start: int
    names: tuple[str, ...]
    indices: torch.Tensor


@dataclass
class Stream:
    """One recorded batch: its steps, their indices (copied `blocks`, then the `held` steps) and padding masks."""

    batch: int
    steps: list[Step] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    # per held step: its router calls' indices as returned and their versions then; `held_names`: their layers
    held: list[tuple[tuple[torch.Tensor, ...], tuple[int | None, ...]]] = field(default_factory=list)
    held_names: tuple[str, ...] = ()
    problem: Exception | None = None  # found while copying, raised when the routes are built
    masks: list[torch.Tensor] = field(default_factory=list)  # bool [B, t] pieces covering the steps from position 0
    # pending decode steps of a generate, their padding read once from the latest mask: (start, end, it or None, device)
    tail: tuple[int, int, torch.Tensor | None, torch.device] | None = None
    final_len: int | None = None
    end: int | None = None  # positions kept (generate(synced_gpus=True) drops the dummy steps past the output)
    # (first column, bool [B, n]: False at the prompt's padding, or at and after a row's EOS) per mask generate left
    keep: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    sequences: torch.Tensor | None = None  # the last generate's (a next turn over its kept cache starts with them)

    def take(
        self, step: Step, names: tuple[str, ...], indices: tuple[torch.Tensor, ...], versions: tuple[int | None, ...],
        experts: dict[str, int],
    ) -> None:  # fmt: skip
        """Add `step` with its router calls (their `Taken`s, transposed; `experts`: E per layer); copy if due."""
        if self.held and (names != self.held_names or step.length != 1):
            self.copy_held(experts)
        self.steps.append(step)
        self.add_mask(step)
        self.held.append((indices, versions))
        self.held_names = names
        if step.length != 1 or len(self.held) >= HOLD:  # a prefill is not held: its indices are B*T*K each
            self.copy_held(experts)

    def copy_held(self, experts: dict[str, int]) -> None:
        """Copy the held steps' indices into one block in the routes' layout (one stack, at most one conversion)."""
        held, self.held = self.held, []
        if not held or self.problem is not None:
            return
        names, first = self.held_names, self.steps[len(self.steps) - len(held)]
        B, t, n, L = self.batch, first.length, len(held), len(self.held_names)  # (n > 1 only for decode steps: t = 1)
        pieces = [p for indices, _ in held for p in indices]
        stacked = None
        if pieces[0].shape[:-1] in ((B * t,), (B, t)):
            try:  # [B*t or B, t, n*L, K]: a copy, as the model may change its tensors later
                stacked = torch.stack(pieces, -2)
            except RuntimeError:  # pieces of different shapes
                pass
        if stacked is None:  # e.g. [B*t, K] and [B, t, K] in one step
            ks = sorted({p.shape[-1] if p.dim() else 0 for p in pieces})
            if len(ks) > 1:
                self.problem = ValueError(f"layers recorded different top-k values {ks}; Routes needs one K")
                return
            if (wrong := next((k for k, p in enumerate(pieces) if p.numel() != B * t * ks[0]), None)) is not None:
                self.problem = UnsupportedModelError(
                    f"router {names[wrong % L]!r} returned top-k indices of shape {tuple(pieces[wrong].shape)} "
                    f"for a forward of {B} x {t} tokens: expected {B * t} rows of K"
                )
                return
            stacked = torch.stack([p.reshape(B, t, ks[0]) for p in pieces], -2)
        stacked = stacked.to(index_dtype(max(experts[name] for name in names)))  # (itself if of that dtype already)
        then, now, changed = [v for _, vs in held for v in vs], versions(pieces), None  # (None: an inference tensor)
        if now != then:  # (a copy made at the router call has no version to compare: None)
            changed = next((k for k, (a, b) in enumerate(zip(now, then, strict=True)) if b not in (None, a)), None)
        if changed is not None:
            self.problem = UnsupportedModelError(
                f"router {names[changed % L]!r}'s top-k indices were changed in place after it returned them, before "
                "moe-replay copied them: the routes would not be the experts the model used"
            )
            return
        self.blocks.append(Block(first.start, names, stacked.view(B, n * t, L, stacked.shape[-1])))

    def add_mask(self, step: Step) -> None:
        """Keep `step`'s padding: copied now (the caller may reuse its mask buffer), except for a decode step, whose
        mask `generate` makes afresh and only extends: the latest is kept, read when the generation ends."""
        mask, end = step.attention, step.start + step.length
        if extends_generation(step):
            tail = self.tail
            if tail is not None and tail[1] == step.start and (tail[2] is None) == (mask is None):
                start = tail[0]  # the pending run goes on
            else:
                self.flush_masks()
                start = step.start
            self.tail = (start, end, mask, step.device)
            if len(self.steps) > 1:  # the step before was taken: only the latest mask is held
                self.steps[-2].attention = None
            return
        self.flush_masks()
        self.masks.append(step.real)

    def flush_masks(self) -> None:
        """Copy the pending decode steps' padding out of the latest mask (and let go of it)."""
        if self.tail is not None:
            start, end, mask, device = self.tail
            if mask is None:
                self.masks.append(torch.ones(self.batch, end - start, dtype=torch.bool, device=device))
            else:
                self.masks.append(mask[:, start:end].to(torch.bool, copy=True))
            self.tail = None

    def indices(self, layers: list[str], experts: dict[str, int], total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [B, T, L, K] in the order of `layers`, mask bool [B, T]) over the positions recorded, T at least
        `total` (a generate's `out.sequences` hold a last token that was never forwarded: masked, expert 0)."""
        self.flush_masks()
        self.copy_held(experts)
        if self.problem is not None:
            raise self.problem
        end = 0
        for step in self.steps:
            if step.start != end:
                raise ValueError(
                    f"positions {end}..{step.start - 1} of a recorded batch were not recorded (a forward that raised?)"
                )
            end += step.length
        ks = sorted({b.indices.shape[-1] for b in self.blocks})
        if len(ks) != 1:
            raise ValueError(f"layers recorded different top-k values {ks}; Routes needs one K")
        order, parts = tuple(layers), []
        for b in self.blocks:
            x = b.indices
            if b.names != order:  # routers that ran in another order, or not at all
                missing = [name for name in layers if name not in b.names]
                if missing:
                    last = b.start + x.shape[1] - 1
                    raise ValueError(f"routers {missing} recorded nothing at positions {b.start}..{last}")
                x = x[:, :, [b.names.index(name) for name in layers]]
            parts.append(x)
        masks = self.masks
        if self.end is not None and self.end < end:  # generate(synced_gpus=True)'s dummy steps, dropped
            end, parts, masks = self.end, [torch.cat(parts, 1)[:, : self.end]], [torch.cat(masks, 1)[:, : self.end]]
        if total > end:
            parts.append(parts[0].new_zeros(self.batch, total - end, len(layers), ks[0]))
            masks = [*masks, masks[0].new_zeros(self.batch, total - end)]
        # new tensors, also of one part: the routes share nothing with the blocks, nor the caller's `&=` with the masks
        return torch.cat(parts, 1), torch.cat(masks, 1)


def hold(indices: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """What a recorder holds of a router call's top-k indices as they are selected: the tensor and its version counter
    now (an in-place edit before they are copied is caught); for an inference tensor (edits not counted) a copy, None.

    Example:
        >>> hold(torch.tensor([[1, 3]]))[1]
        0
    """
    now = version(indices)
    return (indices, now) if now is not None else (indices.clone(), None)
