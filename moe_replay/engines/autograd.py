"""What autograd is doing on this thread: shared by the engines' recompute handling."""

from __future__ import annotations

import sys
import weakref

import torch

REENTRANT_FORWARD = "CheckpointFunction.forward"  # torch's, Megatron's, DeepSpeed's; Transformer Engine's ends so


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (where activation checkpoints recompute their forward).

    Example:
        >>> in_backward()
        False
    """
    return torch._C._current_graph_task_id() != -1


def version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place edit), or None for a tensor made in
    `torch.inference_mode()`, whose edits are not counted.

    Example:
        >>> version(torch.zeros(2).add_(1))
        1
    """
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter."
        return None


def inside_reentrant_checkpoint() -> bool:
    """Whether a reentrant checkpoint's first forward (`CheckpointFunction.forward`) is on the call stack.

    Example:
        >>> inside_reentrant_checkpoint()
        False
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_qualname.endswith(REENTRANT_FORWARD):
            return True
        frame = frame.f_back
    return False


def reentrant_checkpoint_node() -> weakref.ref | None:
    """A weak reference to the autograd node of the innermost reentrant checkpoint whose first forward is on the call
    stack (its `CheckpointFunction.forward`'s `ctx`), or None outside one. When the backward recomputes that forward,
    `torch._C._current_autograd_node()` is this node: a recompute is told from another micro-batch's, even one whose
    input is identical, by which checkpoint's backward runs it.

    Example:
        >>> reentrant_checkpoint_node() is None
        True
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_qualname.endswith(REENTRANT_FORWARD):
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                return weakref.ref(ctx)
        frame = frame.f_back
    return None
