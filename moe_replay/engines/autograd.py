"""What autograd is doing on this thread: shared by the engines' recompute handling."""

from __future__ import annotations

import inspect
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


def checkpoint_chain() -> tuple[weakref.ref, ...]:
    """Weak references to what identifies the activation checkpoints around the running code: the autograd node (the
    `ctx`) of each reentrant checkpoint whose first forward is on the call stack, innermost first, then the frame of
    the innermost non-reentrant checkpoint whose saved-tensor hooks are active. A recompute in the backward is then
    told from another forward's, even one with identical input, by `recomputing()`.

    Example:
        >>> checkpoint_chain()
        ()
    """
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_qualname.endswith(REENTRANT_FORWARD):
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                found.append(weakref.ref(ctx))
        frame = frame.f_back
    hook_frame = _hooks_closure("_checkpoint_hook", "frame")
    if hook_frame is not None:
        try:
            found.append(weakref.ref(hook_frame))
        except TypeError:
            pass
    return tuple(found)


def recomputing() -> object | None:
    """What identifies the checkpoint whose recompute is running (an entry of some `checkpoint_chain()` taken in its
    first forward): the frame of a non-reentrant checkpoint being recomputed (its recomputation hooks are active),
    else the node of a reentrant checkpoint whose backward runs; None otherwise.

    Example:
        >>> recomputing() is None
        True
    """
    ref = _hooks_closure("_recomputation_hook", "target_frame_ref")
    if ref is not None:
        return ref() if callable(ref) else None
    node = torch._C._current_autograd_node()
    return node if is_reentrant_node(node) else None


def is_reentrant_node(node: object) -> bool:
    """Whether autograd node `node` is a reentrant checkpoint's (its forward a `CheckpointFunction.forward`).

    Example:
        >>> is_reentrant_node(None)
        False
    """
    forward = getattr(getattr(node, "_forward_cls", None), "forward", None)
    return forward is not None and getattr(forward, "__qualname__", "").endswith(REENTRANT_FORWARD)


def _hooks_closure(owner: str, name: str) -> object | None:
    """The variable `name` of the active saved-tensor pack hook, if torch.utils.checkpoint's `owner` class made it."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    pack = inspect.unwrap(hooks[0])
    code = getattr(pack, "__code__", None)
    if code is None or not pack.__qualname__.startswith(owner + ".") or name not in code.co_freevars:
        return None
    try:
        return pack.__closure__[code.co_freevars.index(name)].cell_contents
    except (TypeError, ValueError):  # (an empty cell)
        return None
