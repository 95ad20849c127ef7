"""Routes: construction checks, dtypes, slicing, joining, files."""

from __future__ import annotations

import pytest
import torch

from moe_replay import LayerInfo, Routes, RoutesFileError
from moe_replay.routes import index_dtype


def make(B=2, T=3, L=2, K=2, E=8, seed=0) -> Routes:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).reshape(B, T, L, K)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -1] = False
    return Routes(idx, mask, [LayerInfo(f"model.layers.{i}.mlp.gate", E, K) for i in range(L)])


def test_smallest_dtype_and_nbytes():
    assert index_dtype(256) == torch.uint8 and index_dtype(257) == torch.int16
    r = make(E=256)
    assert r.indices.dtype == torch.uint8
    # K bytes per (token, layer) plus one mask byte per token: 2*3*(2*2) + 2*3 = 30
    assert r.nbytes == 30
    big = make(E=300)
    assert big.indices.dtype == torch.int16
    # expert 299 does not fit uint8 and survives the round trip unchanged
    idx = torch.full((1, 1, 1, 2), 299)
    idx[..., 1] = 3
    r300 = Routes(idx, torch.ones(1, 1, dtype=torch.bool), [LayerInfo("g", 300, 2)])
    assert r300.indices.flatten().tolist() == [299, 3]


@pytest.mark.parametrize(
    "idx, match",
    [
        (torch.tensor([[[[0, 8]]]]), r"expert index 8 outside \[0, E=8\)"),
        (torch.tensor([[[[-1, 2]]]]), r"expert index -1 outside"),
        (torch.tensor([[[[3, 3]]]]), r"duplicate experts \[3, 3\] at sequence 0, position 0"),
        (torch.tensor([[[[0.0, 1.0]]]]), r"integer dtype, got torch.float32"),
    ],
)
def test_bad_indices(idx, match):
    with pytest.raises(ValueError, match=match):
        Routes(idx, torch.ones(1, 1, dtype=torch.bool), [LayerInfo("g", 8, 2)])


def test_masked_positions_are_not_checked():
    # position 1 is masked: its (meaningless) duplicate zeros are fine
    r = Routes(torch.tensor([[[[1, 2]], [[0, 0]]]]), torch.tensor([[True, False]]), [LayerInfo("g", 4, 2)])
    assert r.shape == (1, 2, 1, 2)


def test_shape_mismatches_name_both_sides():
    idx = torch.zeros(2, 3, 1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"mask shape \(2, 4\) does not match indices \[B, T\] = \(2, 3\)"):
        Routes(idx, torch.ones(2, 4, dtype=torch.bool), [LayerInfo("g", 4, 1)])
    with pytest.raises(ValueError, match="L=1 layers but 2 LayerInfo"):
        Routes(idx, torch.ones(2, 3, dtype=torch.bool), [LayerInfo("a", 4, 1), LayerInfo("b", 4, 1)])
    with pytest.raises(ValueError, match="top_k=2 but indices have K=1"):
        Routes(idx, torch.ones(2, 3, dtype=torch.bool), [LayerInfo("a", 4, 2)])
    with pytest.raises(ValueError, match="mask must be a bool"):
        Routes(idx, torch.ones(2, 3), [LayerInfo("a", 4, 1)])


def test_slicing():
    r = make(B=4)
    assert r[1].shape == (1, 3, 2, 2) and torch.equal(r[1].indices, r.indices[1:2])
    assert r[-1].batch_size == 1 and torch.equal(r[-1].mask, r.mask[3:])
    sub = r[[3, 0]]
    assert torch.equal(sub.indices, r.indices[[3, 0]]) and torch.equal(sub.mask, r.mask[[3, 0]])
    assert r[1:3].batch_size == 2
    assert r[torch.tensor([True, False, True, False])].batch_size == 2
    with pytest.raises(IndexError):
        r[4]


def test_cat_pads_and_checks_layers():
    a, b = make(B=2, T=3), make(B=1, T=5, seed=1)
    c = Routes.cat([a, b])
    assert c.shape == (3, 5, 2, 2)
    assert not c.mask[:2, 3:].any()  # padding of the shorter part is unrecorded
    assert torch.equal(c.indices[2:], b.indices) and torch.equal(c[0:2].indices[:, :3], a.indices)
    other = Routes(b.indices, b.mask, [LayerInfo(f"x{i}", 8, 2) for i in range(2)])
    with pytest.raises(ValueError, match="different layers"):
        Routes.cat([a, other])


def test_equal_ignores_order_within_k():
    r = make()
    flipped = Routes(r.indices.flip(-1), r.mask, r.layers)
    assert r.equal(flipped) and not torch.equal(r.indices, flipped.indices)
    changed = r.indices.clone()
    changed[0, 0, 0] = torch.tensor([7, 6]) if set(changed[0, 0, 0].tolist()) != {6, 7} else torch.tensor([0, 1])
    assert not r.equal(Routes(changed, r.mask, r.layers))


def test_save_load_roundtrip(tmp_path):
    r = make(E=300)
    path = tmp_path / "r.safetensors"
    r.save(path)
    back = Routes.load(path)
    assert torch.equal(back.indices, r.indices) and torch.equal(back.mask, r.mask) and back.layers == r.layers
    assert back.indices.dtype == torch.int16


def test_truncated_and_foreign_files(tmp_path):
    r = make()
    path = tmp_path / "r.safetensors"
    r.save(path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 7])
    with pytest.raises(RoutesFileError, match="could not be read"):
        Routes.load(tmp_path / "cut.safetensors")
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(RoutesFileError, match="not a moe-replay routes file"):
        Routes.load(tmp_path / "foreign.safetensors")
    (tmp_path / "text.safetensors").write_text("hello")
    with pytest.raises(RoutesFileError):
        Routes.load(tmp_path / "text.safetensors")
    meta = {"format": "moe-replay.routes", "version": "99", "layers": "[]"}
    save_file({"indices": r.indices, "mask": r.mask}, str(tmp_path / "new.safetensors"), metadata=meta)
    with pytest.raises(RoutesFileError, match="version '99'"):
        Routes.load(tmp_path / "new.safetensors")
    meta = {"format": "moe-replay.routes", "version": "1", "layers": '[{"name": "g", "num_experts": 8, "top_k": 2}]'}
    save_file({"indices": r.indices, "mask": r.mask}, str(tmp_path / "mismatch.safetensors"), metadata=meta)
    with pytest.raises(RoutesFileError, match="L=2 layers but 1 LayerInfo"):
        Routes.load(tmp_path / "mismatch.safetensors")


def test_load_without_value_validation_still_checks_shapes(tmp_path):
    r = make()
    r.save(tmp_path / "r.safetensors")
    fast = Routes.load(tmp_path / "r.safetensors", validate=False)
    assert torch.equal(fast.indices, r.indices) and fast.layers == r.layers
