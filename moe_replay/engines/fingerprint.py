"""A few elements of a router call's input, to tell which queued forward an activation recompute re-runs: shared by
the engines' recompute handling (a recompute reproduces its forward's input, up to nondeterministic kernels)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

FINGERPRINT = 64  # elements of the router input kept per queued call to tell calls apart
GOLDEN = (5**0.5 - 1) / 2  # the step between them, as a fraction of the input's size (`fingerprint`)
MATCH_RTOL = 1e-3  # a recompute reproduces its forward's input up to nondeterministic kernels


def fingerprint(x: torch.Tensor) -> torch.Tensor | None:
    """`FINGERPRINT` elements of `x` (a float32 copy), or None for an empty tensor: a golden-ratio sequence over its n
    elements (picked on its device), spread over rows, positions and features alike (evenly spaced ones lined up with
    the rows: at B = 64, each row's first position, alike across batches that share their first token). Its ops run
    outside any dispatch mode, so that selective activation checkpointing neither saves nor expects them.

    Example:
        >>> fingerprint(torch.arange(8.0).reshape(2, 4)).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    if x.numel() == 0:
        return None
    with _disable_current_modes(), torch.no_grad():
        flat, n = x.detach().reshape(-1), x.numel()
        if n <= FINGERPRINT:
            return flat.float().clone()
        return flat[torch.arange(FINGERPRINT, device=flat.device).mul_(round(n * GOLDEN)).remainder_(n)].float()


def matches(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two fingerprints agree (to `MATCH_RTOL` of the larger magnitude).

    Example:
        >>> matches(torch.ones(3), torch.ones(3) + 1e-5), matches(torch.ones(3), torch.zeros(3))
        (True, False)
    """
    if a is None or b is None or a.shape != b.shape:
        return False
    with _disable_current_modes(), torch.no_grad():
        return float((a - b.to(a.device)).abs().max()) <= MATCH_RTOL * (float(a.abs().max()) or 1.0)
