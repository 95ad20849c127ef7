"""The old import paths and names of issue 62 part 4 (the `routes_*.py` modules, `moe_replay.engines.megatron.cp`, the
renamed conversions) work for one release: importing an old module is silent, reading a name from it warns with a
DeprecationWarning naming the new place and gives the object there; a name that never existed stays an
AttributeError."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from moe_replay import LayerInfo, Routes
from moe_replay.engines.megatron import context as megatron_context
from moe_replay.engines.megatron import rows as megatron_rows
from moe_replay.integrations import rollout
from moe_replay.routes import check, core, cp, index, io, layers, packed, placed, rows, segments

MOVED = [  # (old module, old name, new module, new name)
    ("moe_replay", "pack_routes", packed, "to_packed"),
    ("moe_replay", "unpack_routes", packed, "from_packed"),
    ("moe_replay.routes_check", "check_ids", check, "check_ids"),
    ("moe_replay.routes_check", "check_version", check, "check_version"),
    ("moe_replay.routes_check", "CHUNK_IDS", check, "CHUNK_IDS"),
    ("moe_replay.routes_index", "batch_index", index, "batch_index"),
    ("moe_replay.routes_index", "is_integer_scalar", index, "is_integer_scalar"),
    ("moe_replay.routes_io", "save_routes", io, "save_routes"),
    ("moe_replay.routes_io", "load_routes", io, "load_routes"),
    ("moe_replay.routes_io", "FORMAT_VERSION", io, "FORMAT_VERSION"),
    ("moe_replay.routes_layers", "LayerInfo", layers, "LayerInfo"),
    ("moe_replay.routes_layers", "index_dtype", layers, "index_dtype"),
    ("moe_replay.routes_layers", "check_layers", layers, "check_layers"),
    ("moe_replay.routes_layers", "layer_diff", layers, "layer_diff"),
    ("moe_replay.routes_packed", "pack_routes", packed, "to_packed"),
    ("moe_replay.routes_packed", "unpack_routes", packed, "from_packed"),
    ("moe_replay.routes_packed", "Packed", packed, "Packed"),
    ("moe_replay.routes_packed", "PackedRoutes", packed, "PackedRoutes"),
    ("moe_replay.routes_packed", "token_mask", packed, "token_mask"),
    ("moe_replay.routes_packed", "boundaries", packed, "boundaries"),
    ("moe_replay.routes_placed", "PlacedRoutes", placed, "PlacedRoutes"),
    ("moe_replay.routes_rows", "routes_from_rows", rows, "from_rows"),
    ("moe_replay.routes_rows", "decoder_index", rows, "decoder_index"),
    ("moe_replay.routes_rows", "engine_columns", rows, "engine_columns"),
    ("moe_replay.routes_rows", "pad_offsets", rows, "pad_offsets"),
    ("moe_replay.routes_segments", "Segment", segments, "Segment"),
    ("moe_replay.routes_segments", "assemble_routes", segments, "assemble_routes"),
    ("moe_replay.routes_segments", "fresh", segments, "fresh"),
    ("moe_replay.engines.megatron", "CPRoutes", cp, "CPRoutes"),
    ("moe_replay.engines.megatron", "cp_positions", cp, "cp_positions"),
    ("moe_replay.engines.megatron", "thd_cp_positions", cp, "thd_cp_positions"),
    ("moe_replay.engines.megatron", "routes_to_cp", cp, "to_cp"),
    ("moe_replay.engines.megatron", "routes_from_cp", cp, "from_cp"),
    ("moe_replay.engines.megatron", "rows_to_routes", megatron_rows, "from_layer_rows"),
    ("moe_replay.engines.megatron", "routes_to_rows", megatron_rows, "to_layer_rows"),
    ("moe_replay.engines.megatron.cp", "CPRoutes", cp, "CPRoutes"),
    ("moe_replay.engines.megatron.cp", "cp_positions", cp, "cp_positions"),
    ("moe_replay.engines.megatron.cp", "thd_cp_positions", cp, "thd_cp_positions"),
    ("moe_replay.engines.megatron.cp", "padded_len", cp, "padded_len"),
    ("moe_replay.engines.megatron.cp", "check_cp", cp, "check_cp"),
    ("moe_replay.engines.megatron.cp", "part_of", cp, "part_of"),
    ("moe_replay.engines.megatron.cp", "routes_to_cp", cp, "to_cp"),
    ("moe_replay.engines.megatron.cp", "routes_from_cp", cp, "from_cp"),
    ("moe_replay.engines.megatron.cp", "cp_place", megatron_context, "cp_place"),
    ("moe_replay.engines.megatron.rows", "rows_to_routes", megatron_rows, "from_layer_rows"),
    ("moe_replay.engines.megatron.rows", "routes_to_rows", megatron_rows, "to_layer_rows"),
    ("moe_replay.integrations.rollout", "rows_to_routes", rollout, "from_engine_rows"),
]
OLD_MODULES = sorted({m for m, *_ in MOVED if m.split(".")[-1].startswith("routes_") or m.endswith(".cp")})


@pytest.mark.parametrize(("old", "name", "new", "new_name"), MOVED, ids=[f"{m}.{n}" for m, n, *_ in MOVED])
def test_an_old_name_warns_naming_its_new_place_and_is_the_new_object(old, name, new, new_name):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{old}.{name} is deprecated: use {new.__name__}.{new_name}$"):
        value = getattr(module, name)
    assert value is getattr(new, new_name)


@pytest.mark.parametrize("old", OLD_MODULES)
def test_importing_an_old_module_alone_does_not_warn(old):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(importlib.import_module(old))


@pytest.mark.parametrize("old", [*OLD_MODULES, "moe_replay", "moe_replay.engines.megatron"])
def test_names_that_never_existed_stay_attribute_errors_without_a_warning(old):
    module = importlib.import_module(old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("no_such_name", "__wrapped__", "_pad_t"):
            with pytest.raises(AttributeError, match=name):
                getattr(module, name)


def test_the_old_from_imports_still_run_the_new_code():
    routes = Routes(torch.tensor([[[[0, 1]], [[2, 3]]]]), torch.tensor([[True, True]]), [LayerInfo("l0", 4, 2)])
    keep = torch.tensor([[1, 1]])
    with pytest.warns(DeprecationWarning, match="moe_replay.routes.packed.to_packed"):
        from moe_replay import pack_routes
    with pytest.warns(DeprecationWarning, match="moe_replay.routes.packed.from_packed"):
        from moe_replay.routes_packed import unpack_routes
    with pytest.warns(DeprecationWarning, match="moe_replay.routes.cp.to_cp"):
        from moe_replay.engines.megatron import routes_to_cp
    with pytest.warns(DeprecationWarning, match="moe_replay.routes.cp.from_cp"):
        from moe_replay.engines.megatron.cp import routes_from_cp
    with pytest.warns(DeprecationWarning, match="moe_replay.routes.rows.from_rows"):
        from moe_replay.routes_rows import routes_from_rows
    out = pack_routes(routes, keep)
    assert unpack_routes(out.routes, out.cu_seqlens, keep).equal(routes)
    assert routes_from_cp([routes_to_cp(routes, 1, 0)], seq_len=2).equal(routes)
    assert routes_from_rows([routes.indices[0]], routes.layers).equal(routes)


def test_the_package_keeps_the_old_module_s_names():
    """`from moe_replay.routes import ...` of every public name `moe_replay/routes.py` had keeps working, silently."""
    import moe_replay.routes as package

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("Routes", "LayerInfo", "IndexLike", "check_structure", "check_ids", "check_version"):
            assert getattr(package, name) is getattr(core, name)
        for name in ("batch_index", "check_layers", "index_dtype", "layer_diff"):
            assert name in package.__all__ and getattr(package, name) is not None
