"""What autograd is doing on this thread: shared by the engines' recompute handling."""

from __future__ import annotations

import inspect
import sys
import weakref

import torch
import torch.utils.checkpoint

REENTRANT_FORWARD = "CheckpointFunction.forward"  # torch's, Megatron's, DeepSpeed's; Transformer Engine's ends so
REENTRANT_BACKWARD = "CheckpointFunction.backward"
CHECKPOINT_FILE = torch.utils.checkpoint.__file__
CHECKPOINT_MODULE = torch.utils.checkpoint.__name__
CHECKPOINT_HOOK = "_checkpoint_hook"  # the saved-tensor hooks class under which its first forward runs
NON_REENTRANT_UNPACK = CHECKPOINT_HOOK + ".__init__.<locals>.unpack_hook"  # its unpack hook, which recomputes
# the local of a non-reentrant checkpoint's call (`checkpoint` itself before torch 2.14, `_checkpoint_impl` since) that
# holds the generator its forward runs between, whose own frame holds the checkpoint's `_CheckpointFrame`
CHECKPOINT_GENERATOR, CHECKPOINT_STATE = "gen", "new_frame"


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (where activation checkpoints recompute their forward).

    Example:
        >>> in_backward()
        False
    """
    return torch._C._current_graph_task_id() != -1


def version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by each in-place edit), or None for an inference tensor (edits not counted).

    Example:
        >>> version(torch.zeros(2).add_(1))
        1
    """
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter."
        return None


def versions(tensors: list[torch.Tensor]) -> list[int | None]:
    """`version` of each of `tensors`, read in one pass (a recorder checks every held top-k as it copies them).

    Example:
        >>> versions([torch.zeros(2), torch.zeros(2).add_(1)])
        [0, 1]
    """
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference tensor among them
        return [version(t) for t in tensors]


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
    """Weak references to the activation checkpoints around the running code (see `recomputing()`): the frame of the
    innermost non-reentrant one whose saved-tensor hooks are active, then, innermost first, each reentrant one's
    autograd node (`ctx`) and each non-reentrant `torch.utils.checkpoint.checkpoint`'s frame, on the call stack.

    Example:
        >>> checkpoint_chain()
        ()
    """
    hook_frame = _checkpoint_frame()  # (the innermost non-reentrant one, whatever began it)
    found, frame = [] if hook_frame is None else [hook_frame], sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_qualname.endswith(REENTRANT_FORWARD):
            if isinstance(ctx := frame.f_locals.get("ctx"), torch.autograd.function.BackwardCFunction):
                found.append(ctx)
        elif code.co_filename == CHECKPOINT_FILE and CHECKPOINT_GENERATOR in code.co_varnames:  # (non-reentrant)
            if (outer := _generator_frame(frame)) is not None and outer is not hook_frame:
                found.append(outer)
        frame = frame.f_back
    refs = []
    for item in found:
        try:
            refs.append(weakref.ref(item))
        except TypeError:
            pass
    return tuple(refs)


def _generator_frame(frame: object) -> object | None:
    """The `_CheckpointFrame` of the non-reentrant checkpoint called in `frame`, from its generator, or None."""
    state = getattr(frame.f_locals.get(CHECKPOINT_GENERATOR), "gi_frame", None)
    return state.f_locals.get(CHECKPOINT_STATE) if state is not None else None


def within(chain: tuple[weakref.ref, ...], checkpoint: object) -> bool:
    """Whether `checkpoint` (`recomputing()`) is among the checkpoints of `chain` (`checkpoint_chain()`).

    Example:
        >>> within(checkpoint_chain(), None)
        False
    """
    return checkpoint is not None and any(ref() is checkpoint for ref in chain)


def freed(chain: tuple[weakref.ref, ...]) -> bool:
    """Whether every checkpoint of a non-empty `chain` was freed: a call queued inside them, never recomputed yet,
    never will be (its forward's output was dropped, or its checkpoint saved nothing).

    Example:
        >>> freed(())
        False
    """
    return bool(chain) and all(ref() is None for ref in chain)


def recomputing() -> object | None:
    """What identifies the checkpoint whose recompute is running (an entry of its first forward's `checkpoint_chain()`):
    the innermost non-reentrant one's frame (in its unpack hook) or reentrant one's autograd node (in its backward).

    Example:
        >>> recomputing() is None
        True
    """
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_qualname
        if name.endswith(REENTRANT_BACKWARD) and is_reentrant_node(ctx := frame.f_locals.get("ctx")):
            return ctx
        elif name == NON_REENTRANT_UNPACK and frame.f_code.co_filename == CHECKPOINT_FILE:
            return frame.f_locals.get("frame")
        frame = frame.f_back
    return None


def is_reentrant_node(node: object) -> bool:
    """Whether autograd node `node` is a reentrant checkpoint's (its forward a `CheckpointFunction.forward`).

    Example:
        >>> is_reentrant_node(None)
        False
    """
    forward = getattr(getattr(node, "_forward_cls", None), "forward", None)
    return forward is not None and getattr(forward, "__qualname__", "").endswith(REENTRANT_FORWARD)


def checkpoint_pack_hook() -> object | None:
    """The active saved-tensor pack hook (unwrapped) while a non-reentrant checkpoint's first forward runs, else None.

    Example:
        >>> checkpoint_pack_hook() is None
        True
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    pack = inspect.unwrap(hooks[0])
    ours = getattr(pack, "__module__", "") == CHECKPOINT_MODULE
    return pack if ours and getattr(pack, "__qualname__", "").startswith(CHECKPOINT_HOOK + ".") else None


def _checkpoint_frame() -> object | None:
    """The `_CheckpointFrame` of the non-reentrant checkpoint whose pack hook is active (from its closure), or None."""
    pack = checkpoint_pack_hook()
    code = getattr(pack, "__code__", None)
    if code is None or "frame" not in code.co_freevars:
        return None
    try:
        return pack.__closure__[code.co_freevars.index("frame")].cell_contents
    except (TypeError, ValueError):  # (an empty cell)
        return None
