"""The per-id check of `Routes`: expert ids in [0, E) for their layer and distinct within each (token, layer).

It is memory-bound work, done in cache-sized chunks of tokens, with no sort and no int64 copy. Per chunk: one max
(and for signed dtypes one min) over [tokens, L·K] for the range; for duplicates, the chunk's ids as one flat run of
(token, layer) groups of K, each group offset by its parity (+E_max on odd groups, so that no id of one group can
equal an id of the next), then K − 1 tests of the run against itself shifted by 1 .. K − 1 (an xor, and a min
that looks for a zero): every pair inside a group is compared once, and pairs across groups never match. All
contiguous, vectorised ops; one host sync at the end (a failing check then finds the first offending entry for its
message).

Shape legend: N tokens, L layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHUNK_IDS = 1 << 20  # ids per chunk: small enough that the K − 1 passes over it stay in cache


def check_ids(indices: torch.Tensor, mask: torch.Tensor, layers: Sequence) -> None:
    """Raise ValueError unless every recorded (token, layer) of `indices` [B, T, L, K] (recorded where `mask`
    [B, T] is True) holds K distinct expert ids in [0, E) of its layer; the message names the entry and both sides.

    Example:
        >>> check_ids(torch.tensor([[[[0, 1]]]]), torch.tensor([[True]]), [LayerInfo("l0", 2, 2)])  # doctest: +SKIP
    """
    B, T, L, K = indices.shape
    if indices.numel() == 0 or L == 0:
        return
    flat = indices.reshape(B * T, L * K)
    keep = mask.reshape(B * T)
    all_kept = bool(keep.all())
    step = max(2, CHUNK_IDS // (L * K)) // 2 * 2  # whole tokens, an even number of groups per chunk
    hi = torch.full((L * K,), torch.iinfo(indices.dtype).min, dtype=indices.dtype, device=indices.device)
    lo = torch.zeros(L * K, dtype=indices.dtype, device=indices.device)
    dup = torch.zeros((), dtype=torch.bool, device=indices.device)
    top = max(layer.num_experts for layer in layers)
    wide = _run_dtype(indices.dtype, top)
    groups = torch.arange(min(step, B * T) * L, device=indices.device) % 2  # the parity of each (token, layer) group
    parity = groups.to(wide).mul_(top).repeat_interleave(K) if K > 1 else None
    buffers = (torch.empty_like(parity), torch.empty_like(parity)) if K > 1 else None
    gathered = None if all_kept else flat.new_empty((min(step, B * T), L * K))
    for start in range(0, B * T, step):
        chunk = flat[start : start + step]
        if not all_kept:  # gather the recorded tokens into a reused buffer (a fresh one page-faults)
            rows = keep[start : start + step].nonzero().flatten()
            chunk = torch.index_select(chunk, 0, rows, out=gathered[: rows.numel()])
        if chunk.shape[0] == 0:
            continue
        torch.maximum(hi, chunk.amax(0), out=hi)
        if indices.dtype.is_signed:
            torch.minimum(lo, chunk.amin(0), out=lo)
        if K > 1:
            dup |= _has_duplicate(chunk.reshape(-1), K, parity, buffers)
    los, his = lo.reshape(L, K).amin(1).tolist(), hi.reshape(L, K).amax(1).tolist()
    for i, layer in enumerate(layers):
        if los[i] < 0 or his[i] >= layer.num_experts:
            bad = los[i] if los[i] < 0 else his[i]
            raise ValueError(f"layer {layer.name!r}: expert index {bad} outside [0, E={layer.num_experts})")
    if bool(dup):
        _raise_duplicate(indices, mask, layers)


def _run_dtype(dtype: torch.dtype, top: int) -> torch.dtype:
    """The narrowest dtype that holds ids below `top` plus a parity offset of `top` (the ids are range-checked)."""
    if 2 * top <= 256 and dtype == torch.uint8:
        return torch.uint8
    return torch.int16 if 2 * top <= 2**15 else torch.int32


def _has_duplicate(
    run: torch.Tensor, K: int, parity: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Whether any group of K consecutive ids of `run` (a multiple of K long) holds an id twice (a 0-d bool tensor),
    with `parity` (at least as long) the offsets of alternate groups: x ^ x shifted by k is zero exactly where two
    ids k apart are equal, and the min finds a zero (`any` over a bool tensor is several times slower on CPU).
    `buffers` (two runs' worth, in the offset dtype) are reused across chunks: fresh large allocations page-fault.
    Out-of-range ids may give a false alarm here; the range check reports them first."""
    n = run.numel()
    y, tmp = buffers[0][:n], buffers[1][:n]
    torch.add(run, parity[:n], out=y)  # widens a narrower run
    lows = [torch.bitwise_xor(y[:-k], y[k:], out=tmp[: n - k]).amin() for k in range(1, K)]
    return torch.stack(lows).amin() == 0


def _raise_duplicate(indices: torch.Tensor, mask: torch.Tensor, layers: Sequence) -> None:
    """Find the first recorded (token, layer) with a repeated expert and raise naming it (the slow path)."""
    K = indices.shape[-1]
    for b in range(indices.shape[0]):
        rows = indices[b][mask[b]]  # [t, L, K]
        hit = torch.zeros(rows.shape[:2], dtype=torch.bool, device=rows.device)
        for k in range(1, K):
            hit |= (rows[..., k:] == rows[..., :-k]).any(-1)
        if hit.any():
            n, layer = (int(v) for v in hit.nonzero()[0])
            t = int(mask[b].nonzero()[n])
            raise ValueError(
                f"duplicate experts {rows[n, layer].tolist()} at sequence {b}, position {t}, "
                f"layer {layers[layer].name!r}: the K experts of a token must be distinct"
            )
    raise AssertionError("a duplicate was counted but not found")  # pragma: no cover


def check_version(version: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """`version` as the int32 [B, T] tensor `Routes` keeps (None stays None): integer, shaped and placed like `mask`,
    >= 0 at recorded positions; else ValueError naming both sides.

    Example:
        >>> check_version(torch.tensor([[0, 1]]), torch.tensor([[True, True]])).dtype
        torch.int32
    """
    if version is None:
        return None
    if not isinstance(version, torch.Tensor) or version.dtype.is_floating_point or version.dtype == torch.bool:
        raise ValueError(f"version must be an integer tensor [B, T], got {getattr(version, 'dtype', type(version))}")
    if version.shape != mask.shape or version.device != mask.device:
        raise ValueError(
            f"version is {tuple(version.shape)} on {version.device}; the mask is {tuple(mask.shape)} on {mask.device}"
        )
    recorded = version[mask].long()
    if recorded.numel() and (recorded.min() < 0 or recorded.max() >= 2**31):
        raise ValueError(
            f"versions must be in [0, 2**31) at recorded positions, got {int(recorded.min())}..{int(recorded.max())}"
        )
    return version.to(torch.int32)
