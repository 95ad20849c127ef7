"""The chunked id check against a brute-force reference: ranges, duplicates across chunk boundaries, masks, dtypes."""

from __future__ import annotations

import pytest
import torch

import moe_replay.routes.check as routes_check
from moe_replay.routes import LayerInfo
from moe_replay.routes.check import check_ids


def distinct(B: int, T: int, L: int, K: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, L, E, generator=g).argsort(-1)[..., :K].to(dtype)


def reference_has_duplicate(indices: torch.Tensor, mask: torch.Tensor) -> bool:
    s = indices[mask].long().sort(-1).values
    return bool((s[..., 1:] == s[..., :-1]).any())


@pytest.mark.parametrize(
    "L, K, E, dtype",
    [
        (3, 2, 8, torch.uint8),
        (2, 8, 128, torch.uint8),
        (2, 4, 200, torch.uint8),
        (2, 3, 300, torch.int16),
        (1, 6, 64, torch.int32),
        (4, 1, 5, torch.uint8),
    ],
)
def test_duplicates_anywhere_are_found_and_only_them(monkeypatch, L, K, E, dtype):
    monkeypatch.setattr(routes_check, "CHUNK_IDS", 5 * L * K)  # chunks of 4 tokens: many chunk boundaries
    B, T = 3, 7
    layers = [LayerInfo(f"model.layers.{i}.mlp.gate", E, K) for i in range(L)]
    g = torch.Generator().manual_seed(1)
    for trial in range(12):
        idx = distinct(B, T, L, K, E, dtype, trial)
        mask = torch.rand(B, T, generator=g) > (0.3 if trial % 2 else 0.0)
        idx[~mask] = 0  # unrecorded positions hold zeros (duplicates there are not errors)
        if K > 1 and trial % 3:
            b, t = int(torch.randint(B, (1,), generator=g)), int(torch.randint(T, (1,), generator=g))
            layer = int(torch.randint(L, (1,), generator=g))
            i, j = torch.randperm(K, generator=g)[:2].tolist()
            idx[b, t, layer, j] = idx[b, t, layer, i]
        expected = reference_has_duplicate(idx, mask)
        if expected:
            with pytest.raises(ValueError, match="duplicate experts"):
                check_ids(idx, mask, layers)
        else:
            check_ids(idx, mask, layers)


def test_out_of_range_ids_name_the_layer(monkeypatch):
    monkeypatch.setattr(routes_check, "CHUNK_IDS", 8)
    layers = [LayerInfo("a", 4, 2), LayerInfo("b", 6, 2)]
    idx = distinct(2, 5, 2, 2, 4, torch.int16, 0)
    mask = torch.ones(2, 5, dtype=torch.bool)
    idx[1, 4, 1, 0] = 6
    with pytest.raises(ValueError, match="layer 'b': expert index 6 outside \\[0, E=6\\)"):
        check_ids(idx, mask, layers)
    idx[1, 4, 1, 0] = -1
    with pytest.raises(ValueError, match="layer 'b': expert index -1 outside"):
        check_ids(idx, mask, layers)
    mask[1, 4] = False  # an unrecorded position is not checked
    check_ids(idx, mask, layers)
