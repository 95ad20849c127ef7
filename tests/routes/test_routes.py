"""Routes: construction checks, dtypes, slicing, joining, files."""

from __future__ import annotations

import json

import numpy as np
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


def _save_raw(path, indices, mask, layers):
    """A file with the routes header around any tensors, as a foreign or corrupted writer could produce."""
    from safetensors.torch import save_file

    meta = {"format": "moe-replay.routes", "version": "1", "layers": json.dumps([vars(x) for x in layers])}
    save_file({"indices": indices, "mask": mask}, str(path), metadata=meta)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize(
    "indices, mask, match",
    [
        # B differs: the old validate=False check compared B=0 slices of both and passed
        (torch.zeros(4, 6, 2, 2, dtype=torch.uint8), torch.ones(3, 6, dtype=torch.bool), r"\(3, 6\).*\(4, 6\)"),
        (torch.zeros(4, 6, 2, 2, dtype=torch.uint8), torch.ones(4, 5, dtype=torch.bool), r"\(4, 5\).*\(4, 6\)"),
        (torch.zeros(4, 6, 2, 2, dtype=torch.uint8), torch.ones(4, 6, dtype=torch.uint8), "mask must be a bool"),
        (torch.zeros(4, 6, 2, 2), torch.ones(4, 6, dtype=torch.bool), "integer dtype, got torch.float32"),
        (torch.zeros(4, 6, 3, 2, dtype=torch.uint8), torch.ones(4, 6, dtype=torch.bool), "L=3 layers but 2 LayerInfo"),
        (torch.zeros(4, 6, 2, 1, dtype=torch.uint8), torch.ones(4, 6, dtype=torch.bool), "top_k=2 but .* K=1"),
        # a 0-d tensor has no batch to slice: the old check raised a bare IndexError
        (torch.tensor(0, dtype=torch.uint8), torch.ones(4, 6, dtype=torch.bool), r"\[B, T, L, K\] tensor, got \(\)"),
    ],
)
def test_load_checks_structure_with_or_without_validation(tmp_path, validate, indices, mask, match):
    path = tmp_path / "bad.safetensors"
    _save_raw(path, indices, mask, make().layers)  # two layers of E=8, top_k=2
    with pytest.raises(RoutesFileError, match=match):
        Routes.load(path, validate=validate)


def test_load_without_validation_narrows_dtype_only_after_checking_ids(tmp_path):
    # int64 ids in a file for E=8 (save writes uint8): narrowing 300 to uint8 would give 44, a valid-looking id, so a
    # file that needs narrowing has its ids checked even with validate=False
    layers = [LayerInfo("g", 8, 2)]
    _save_raw(tmp_path / "wide.safetensors", torch.tensor([[[[300, 1]]]]), torch.ones(1, 1, dtype=torch.bool), layers)
    with pytest.raises(RoutesFileError, match=r"expert index 300 outside \[0, E=8\)"):
        Routes.load(tmp_path / "wide.safetensors", validate=False)
    _save_raw(tmp_path / "ok.safetensors", torch.tensor([[[[5, 1]]]]), torch.ones(1, 1, dtype=torch.bool), layers)
    back = Routes.load(tmp_path / "ok.safetensors", validate=False)
    assert back.indices.dtype == torch.uint8 and back.indices.flatten().tolist() == [5, 1]


@pytest.mark.parametrize(
    "empty",
    [
        [],  # torch.as_tensor([]) is float32: it used to raise IndexError
        torch.tensor([], dtype=torch.long),
        torch.tensor([]),  # what torch.tensor(ids) gives for an empty id list
        np.array([]),  # float64, like torch's own tensor[np.array([])]
        np.array([], dtype=np.int64),
        slice(5, None),
    ],
    ids=["list", "long", "float", "numpy", "numpy-int", "slice"],
)
def test_empty_index_gives_empty_batch(empty):
    r = make(B=4)
    sub = r[empty]
    # B=0 with T, L, K, layers and dtypes kept, as r.indices[[]] and r.mask[[]] would
    assert sub.shape == (0, 3, 2, 2) and sub.mask.shape == (0, 3) and sub.layers == r.layers
    assert sub.indices.dtype == torch.uint8 and sub.mask.dtype == torch.bool
    assert len(sub) == 0 and "recorded=0 positions" in repr(sub)
    # an empty batch still joins: cat with it is the other part
    assert Routes.cat([sub, r]).equal(r)


def test_empty_bool_mask_selects_from_empty_batch_only():
    r = make(B=4)
    empty0 = r[[]]
    assert empty0[torch.tensor([], dtype=torch.bool)].shape == (0, 3, 2, 2)
    assert empty0[np.array([], dtype=bool)].shape == (0, 3, 2, 2)
    with pytest.raises(ValueError, match=r"boolean index of shape \(0,\) does not match B=4"):
        r[torch.tensor([], dtype=torch.bool)]


def test_index_forms_select_like_tensor_indexing():
    r = make(B=4)
    # each form selects the same rows of indices and mask as plain tensor indexing with the same ids
    for idx, rows in [
        ([-1, -4], [3, 0]),
        (np.array([2, 0]), [2, 0]),  # numpy arrays used to fail in int(idx)
        (np.array([True, False, False, True]), [0, 3]),
        (torch.tensor([1, 3], dtype=torch.int32), [1, 3]),
        (torch.tensor([1, -1], dtype=torch.int16), [1, 3]),  # int8 / int16 ids raised torch's own IndexError
        (np.array([2, 1], dtype=np.int8), [2, 1]),
        (slice(None, None, 2), [0, 2]),
        (slice(1, None, 2), [1, 3]),
        (np.int64(-1), [3]),
        (torch.tensor(-2), [2]),
        (range(1, 3), [1, 2]),
    ]:
        sub = r[idx]
        assert torch.equal(sub.indices, r.indices[rows]) and torch.equal(sub.mask, r.mask[rows]), idx


@pytest.mark.parametrize(
    "idx, match",
    [
        # each of these gave a Routes with no error: r[True] was r[1], r[False] was r[0], a 2-D list a 5-D Routes
        (True, "a bool is not a batch index"),
        (False, "a bool is not a batch index"),
        ([[0, 1], [2, 3]], r"index list must be 1-D, got shape \(2, 2\)"),
        # torch reads a uint8 tensor as a mask (deprecated): [3, 0, 1, 1] would select rows 0, 2, 3
        (torch.tensor([3, 0, 1, 1], dtype=torch.uint8), "uint8 index is ambiguous"),
        (np.array([3, 0], dtype=np.uint8), "uint8 index is ambiguous"),
        ([0.5], "must hold integers or bools, got torch.float32"),
        ([True, False], r"boolean index of shape \(2,\) does not match B=4"),
        (torch.ones(4, 3, dtype=torch.bool), r"boolean index of shape \(4, 3\) does not match B=4"),
        (torch.tensor(True), r"boolean index of shape \(\) does not match B=4"),
        (None, "cannot index Routes with NoneType"),
        (Ellipsis, "cannot index Routes with ellipsis"),
        ((0, 1), "sliced along the batch only"),
        (slice(None, None, -1), "step must be greater than zero"),
    ],
)
def test_bad_index_forms_raise_value_error(idx, match):
    with pytest.raises(ValueError, match=match):
        make(B=4)[idx]


def test_empty_dimensions_construct():
    # no ids to check: B=0, T=0 or no layers (L=0) build like any other Routes (L=0 used to fail in a reshape)
    for B, T, L in [(0, 3, 2), (2, 0, 2), (2, 3, 0)]:
        r = Routes(
            torch.zeros(B, T, L, 2, dtype=torch.long),
            torch.ones(B, T, dtype=torch.bool),
            [LayerInfo(f"l{i}", 4, 2) for i in range(L)],
        )
        assert r.shape == (B, T, L, 2) and r.indices.dtype == torch.uint8
