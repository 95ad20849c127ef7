"""Batch indices of `Routes`: which sequences `routes[idx]` selects, and why an index is refused."""

from __future__ import annotations

import operator

import torch


def batch_index(idx: object, B: int, device: torch.device) -> slice | torch.Tensor:
    """`idx` as a slice or a 1-D long or bool tensor that selects along B, or a ValueError that says why not."""
    if isinstance(idx, bool):  # an int to isinstance, but torch reads it as a new dim, not as sequence 0 or 1
        raise ValueError(f"a bool is not a batch index: use an int, or a bool mask of length B={B}")
    if isinstance(idx, tuple):
        raise ValueError("Routes are sliced along the batch only: routes[idx] with idx an int, slice or index list")
    if isinstance(idx, slice):
        return idx
    if is_integer_scalar(idx):
        i = operator.index(idx)
        if not -B <= i < B:
            raise IndexError(f"index {i} out of range for B={B}")
        return slice(i, i + 1 if i != -1 else None)
    try:
        t = torch.as_tensor(idx, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"cannot index Routes with {type(idx).__name__}: use an int, a slice, a 1-D list, tensor or array of "
            f"ids, or a bool mask of length B={B}"
        ) from e
    if t.dtype == torch.bool:
        if t.shape != (B,):
            raise ValueError(f"boolean index of shape {tuple(t.shape)} does not match B={B}")
        return t
    if t.dim() == 1 and t.numel() == 0:  # [] and np.array([]) are float: select nothing, as tensor[[]] does
        return t.long()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        raise ValueError(f"a Routes index must hold integers or bools, got {t.dtype}")
    if t.dtype == torch.uint8:  # torch would read it as a mask, which an id list of expert-sized ints is not
        raise ValueError("a uint8 index is ambiguous (torch reads it as a mask): use .bool() for a mask or .long()")
    if t.dim() != 1:
        raise ValueError(f"a Routes index list must be 1-D, got shape {tuple(t.shape)}")
    return t if t.dtype in (torch.long, torch.int32) else t.long()  # (torch indexes with these alone)


def is_integer_scalar(x: object) -> bool:
    """A 0-d integer tensor, a numpy integer or 0-d integer array: an index that keeps the batch dim like an int."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)  # ints, numpy integers and 0-d integer arrays; not 1-D arrays, which __index__ refuses
    except TypeError:
        return False
    return True
