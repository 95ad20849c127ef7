"""What autograd is doing on this thread: shared by the engines' recompute handling."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (where activation checkpoints recompute their forward).

    Example:
        >>> in_backward()
        False
    """
    return torch._C._current_graph_task_id() != -1
