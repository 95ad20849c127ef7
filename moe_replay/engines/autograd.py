"""What autograd is doing on this thread: shared by the engines' recompute handling."""

from __future__ import annotations

import sys

import torch

REENTRANT_FORWARD = "CheckpointFunction.forward"  # torch's (and Megatron's, DeepSpeed's) reentrant checkpoint


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
        if frame.f_code.co_qualname == REENTRANT_FORWARD:
            return True
        frame = frame.f_back
    return False
