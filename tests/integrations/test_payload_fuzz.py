"""Fuzzed engine payloads (issue 44): whatever vLLM or SGLang returns that is not a valid routes payload is refused
with a ValueError naming the engine, the response (vLLM `output i`, SGLang `response i`) and the field; never
EOFError, BadZipFile, ZeroDivisionError, TypeError or numpy's own messages.

The strict tests break one response of an otherwise valid batch in one way that can never be valid, and expect a
refusal; the open ones put arbitrary JSON, arrays or bytes anywhere, and accept either an import or a named
refusal. Deterministic (derandomized, no example database) and a few seconds in all."""

from __future__ import annotations

import base64
import copy
import io
import re
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst

from moe_replay import LayerInfo, Routes
from moe_replay.integrations.sglang import routes_from_sglang
from moe_replay.integrations.vllm import routes_from_vllm

LAYERS = (LayerInfo("model.layers.0.mlp.gate", 8, 2), LayerInfo("model.layers.2.mlp.gate", 8, 2))
P, N = 4, 3  # prompt and completion tokens of every response
ROWS, COLUMNS, K = P + N - 1, 3, 2  # positions, engine columns (decoder layers, layer 1 dense), experts per token
FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
OPEN = settings(FUZZ, max_examples=150)

# -- valid payloads ------------------------------------------------------------------------------------------------


def good_routes(n: int = ROWS, columns: int = COLUMNS, dtype: Any = np.int32) -> np.ndarray:
    """[n, columns, K]: position p routes to experts p and p + 1 (mod 8) in every column."""
    ids = (np.arange(n)[:, None, None] + np.arange(K)) % 8
    return np.broadcast_to(ids, (n, columns, K)).astype(dtype)


def npy(array: np.ndarray, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, **kwargs)
    return buf.getvalue()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


VLLM_FORMS = ("offline", "server", "split", "offline_split")
SPLIT = ("split", "offline_split")


def vllm_output(form: str, choices: int = 1) -> Any:
    """One valid vLLM output: `RequestOutput`-like (offline) or server JSON, per-completion or split form."""
    if form in SPLIT:
        full = good_routes(ROWS, len(LAYERS), np.int16)
        prompt, completion = full[:P], full[P:]
        if form == "offline_split":
            outputs = [
                SimpleNamespace(index=c, token_ids=[7] * N, routed_experts=completion.copy()) for c in range(choices)
            ]
            return SimpleNamespace(
                prompt_token_ids=[5] * P, prompt_routed_experts=prompt, num_cached_tokens=0, outputs=outputs
            )
        return {
            "prompt_token_ids": [5] * P,
            "prompt_routed_experts": prompt.tolist(),
            "choices": [
                {"index": c, "token_ids": [7] * N, "routed_experts": completion.tolist()} for c in range(choices)
            ],
            "usage": {"prompt_tokens_details": {"cached_tokens": 0}},
        }
    if form == "server":
        routes = b64(npy(good_routes(dtype=np.uint8)))
        return {
            "prompt_token_ids": [5] * P,
            "choices": [{"index": c, "token_ids": [7] * N, "routed_experts": routes} for c in range(choices)],
        }
    outputs = [SimpleNamespace(index=c, token_ids=[7] * N, routed_experts=good_routes()) for c in range(choices)]
    return SimpleNamespace(prompt_token_ids=[5] * P, prompt_routed_experts=None, outputs=outputs)


def sglang_response(form: str) -> dict:
    """One valid SGLang response: native (`meta_info`) or OpenAI-style (`usage` + `sglext`)."""
    payload = b64(good_routes().astype("<i4").tobytes())
    if form == "native":
        return {"text": "", "meta_info": {"prompt_tokens": P, "completion_tokens": N, "routed_experts": payload}}
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}}],
        "usage": {"prompt_tokens": P, "completion_tokens": N},
        "sglext": {"routed_experts": payload},
    }


def test_the_unbroken_payloads_import():
    expected = Routes.from_rows([good_routes()] * 2, LAYERS, seq_len=P + N)  # (T: the token counts' batch length)
    for form in VLLM_FORMS:
        assert routes_from_vllm([vllm_output(form), vllm_output(form)], LAYERS).equal(expected), form
    for form in ("native", "openai"):
        responses = [sglang_response(form), sglang_response(form)]
        assert routes_from_sglang(responses, LAYERS, num_layers=COLUMNS).equal(expected), form


# -- what breaks a response -------------------------------------------------------------------------------------------


def put(obj: Any, key: str, value: Any) -> None:
    if isinstance(obj, dict):
        obj[key] = value
    else:
        setattr(obj, key, value)


def get(obj: Any, key: str) -> Any:
    return obj[key] if isinstance(obj, dict) else getattr(obj, key)


def choice0(out: Any) -> Any:
    return get(out, "choices" if isinstance(out, dict) else "outputs")[0]


def encode_like(form: str, array: np.ndarray) -> Any:
    """An array as the form carries it: base64 `.npy` (server), nested lists (server split) or the array."""
    return b64(npy(array)) if form == "server" else array.tolist() if form == "split" else array


small_dict = st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6))
json_any = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=12
)
non_integral = st.floats().filter(lambda x: not x == int(x) if np.isfinite(x) else True)
not_a_count = st.one_of(
    st.none(), st.booleans(), st.integers(max_value=-1), non_integral, st.text(max_size=5), small_dict
)
not_an_index = st.one_of(
    st.booleans(),
    st.integers(max_value=-1),
    non_integral,
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    small_dict,
)
not_a_container = st.one_of(
    st.integers(), st.floats(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=3)
)
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, ">i4", ">u2"]
NOT_INT_DTYPES = [np.float16, np.float32, np.float64, np.bool_, np.complex64, "U3", "M8[s]", [("a", "<i4")]]


def bad_id(draw: st.DrawFn, dtype: Any) -> int:
    """An expert id outside [0, 8) that `dtype` holds."""
    info = np.iinfo(np.dtype(dtype))
    low = st.integers(info.min, -1) if info.min < 0 else st.nothing()
    edges = [
        v
        for v in (int(info.max), 2**63 + 5, 2**63 - 1, -1, int(info.min))
        if info.min <= v <= info.max and not 0 <= v < 8
    ]
    return draw(st.one_of(low, st.integers(8, info.max), st.sampled_from(edges)))


def broken_ids(draw: st.DrawFn, n: int, columns: int, picked: list[int]) -> tuple[np.ndarray, str]:
    """A well-formed array with one id out of range (named as given) or one token's experts repeated."""
    dtype = draw(st.sampled_from(INT_DTYPES))
    array = good_routes(n, columns, dtype).copy()
    p, col = draw(st.integers(0, n - 1)), draw(st.sampled_from(picked))
    if draw(st.booleans()):
        array[p, col, 1] = array[p, col, 0]
        return array, "duplicate experts"
    value = bad_id(draw, dtype)
    array[p, col, 0] = value
    return array, rf"(expert id|is) {value}\b"  # (outside [0, E), or does not fit int64)


def nested_junk(draw: st.DrawFn, array: np.ndarray) -> list:
    """`array` as nested lists broken one way: ragged, a null, floats, bools, strings, too deep or shallow, an id
    that fits no integer dtype, or too few positions."""
    rows = array.tolist()
    how = draw(st.sampled_from(["ragged", "null", "float", "bool", "str", "deep", "shallow", "huge", "short"]))
    p, c, k = (draw(st.integers(0, s - 1)) for s in array.shape)
    if how == "ragged":
        target = draw(st.sampled_from([rows[p], rows[p][c]]))
        target.append(0) if draw(st.booleans()) else target.pop()
    elif how == "null":
        at = draw(st.sampled_from(["row", "layer", "id"]))
        if at == "row":
            rows[p] = None
        elif at == "layer":
            rows[p][c] = None
        else:
            rows[p][c][k] = None
    elif how in ("float", "bool", "str"):
        rows = array.astype({"float": float, "bool": bool, "str": str}[how]).tolist()
        if how == "float" and draw(st.booleans()):
            rows[p][c][k] += 0.5
    elif how == "deep":
        rows = [rows]
    elif how == "shallow":
        rows = rows[p]
    elif how == "huge":
        rows[p][c][k] = draw(st.sampled_from([2**64, -(2**63) - 1, 2**100]))
    else:
        rows = rows[:-1]
    return rows


def routes_junk(draw: st.DrawFn, form: str) -> Any:
    """A routed_experts value that can never be valid: not base64, base64 of something that is not a whole `.npy` of
    integers, an `.npz`, a pickle, broken nested lists, or a scalar or mapping."""
    good = good_routes(N - 1, len(LAYERS)) if form in SPLIT else good_routes()
    how = draw(
        st.sampled_from(
            ["text", "bytes", "header", "dtype", "truncated", "trailing", "npz", "pickle", "zip", "lists", "scalar"]
        )
    )
    if how == "text":
        return draw(st.text(max_size=40))  # at most 30 bytes: shorter than any .npy header
    if how == "bytes":
        raw = draw(st.binary(max_size=300).filter(lambda b: not b.startswith(b"\x93NUMPY")))
    elif how == "header":
        raw = b"\x93NUMPY" + draw(st.binary(max_size=200))
    elif how == "dtype":
        dtype = draw(st.sampled_from(NOT_INT_DTYPES))
        array = draw(npst.arrays(np.dtype(dtype), good.shape))
        if form in ("offline", "offline_split") and draw(st.booleans()):
            return array
        raw = npy(array)
    elif how in ("truncated", "trailing"):
        full = npy(good.astype(draw(st.sampled_from(INT_DTYPES))))
        cut = draw(st.integers(0, len(full) - 1))
        raw = full[:cut] if how == "truncated" else full + draw(st.binary(min_size=1, max_size=20))
    elif how == "npz":
        buf = io.BytesIO()
        np.savez(buf, routed_experts=good)
        raw = buf.getvalue()
    elif how == "pickle":
        raw = npy(good.astype(object), allow_pickle=True)
    elif how == "zip":
        raw = b"PK\x03\x04" + draw(st.binary(max_size=100))
    elif how == "lists":
        return nested_junk(draw, good)
    else:
        return draw(st.one_of(not_a_container.filter(lambda v: not isinstance(v, str | list)), small_dict))
    return b64(raw) if draw(st.booleans()) else b64(raw).encode()


def wrong_shape(draw: st.DrawFn, form: str) -> np.ndarray:
    """Integer routes of a shape no layout accepts (wrong ndim, positions, K, or fewer than 2 columns)."""
    need = (N - 1, len(LAYERS), K) if form in SPLIT else None

    def fits(s: tuple[int, ...]) -> bool:
        return s == need if need else len(s) == 3 and s[0] == ROWS and s[1] >= 2 and s[2] == K

    shape = draw(npst.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7).filter(lambda s: not fits(s)))
    return np.zeros(shape, dtype=draw(st.sampled_from(INT_DTYPES)))


@st.composite
def vllm_case(draw: st.DrawFn) -> tuple[list, int, str]:
    """Valid outputs with output `r` broken one way, and what the refusal must name besides the output."""
    form = draw(st.sampled_from(VLLM_FORMS))
    n = draw(st.integers(1, 3))
    r = draw(st.integers(0, n - 1))
    outputs = [vllm_output(form) for _ in range(n)]
    out = outputs[r]
    kinds = ["routes", "shape", "ids", "count", "wrong_count", "index", "twice", "choices", "choice", "output"]
    kinds += ["prompt_routes", "cached"] if form in SPLIT else []
    kind = draw(st.sampled_from(kinds))
    if kind == "routes":
        put(choice0(out), "routed_experts", None if draw(st.integers(0, 9)) == 0 else routes_junk(draw, form))
        return outputs, r, "routed_experts"
    if kind == "shape":
        put(choice0(out), "routed_experts", encode_like(form, wrong_shape(draw, form)))
        return outputs, r, r"routed_experts|positions|K=|columns"
    if kind == "ids":
        split = form in SPLIT
        array, match = broken_ids(
            draw, N - 1 if split else ROWS, len(LAYERS) if split else COLUMNS, [0, 1] if split else [0, 2]
        )
        put(choice0(out), "routed_experts", encode_like(form, array))
        return outputs, r, "routed_experts.*" + match
    if kind in ("count", "wrong_count"):
        field = draw(st.sampled_from(["prompt_token_ids", "token_ids"]))
        owner = out if field == "prompt_token_ids" else choice0(out)
        true = P if field == "prompt_token_ids" else N
        if kind == "count":
            put(owner, field, draw(not_a_count))
            return outputs, r, field
        put(
            owner,
            field,
            draw(
                st.integers(0, 9).filter(lambda v: v != true)
                | st.lists(st.just(3), max_size=9).filter(lambda v: len(v) != true)
            ),
        )
        return outputs, r, r"routes hold \d+ positions but its"
    if kind == "index":
        put(choice0(out), "index", draw(not_an_index))
        return outputs, r, "index"
    if kind == "twice":
        outputs[r] = out = vllm_output(form, choices=2)
        put(get(out, "choices" if isinstance(out, dict) else "outputs")[1], "index", 0)
        return outputs, r, "index 0"
    if kind == "choices":
        put(
            out,
            "choices" if isinstance(out, dict) else "outputs",
            draw(st.one_of(st.none(), st.just([]), not_a_container.filter(lambda v: v != []), st.just({"0": {}}))),
        )
        return outputs, r, "completion|choices|outputs"
    if kind == "choice":
        get(out, "choices" if isinstance(out, dict) else "outputs")[0] = draw(st.none() | not_a_container)
        return outputs, r, "completion 0"
    if kind == "output":
        outputs[r] = draw(st.none() | not_a_container)
        return outputs, r, "RequestOutput"
    if kind == "prompt_routes":
        prompt = good_routes(P, len(LAYERS), np.int16)
        junk = draw(st.sampled_from(["lists", "shape", "text", "scalar"]))
        value = {
            "lists": lambda: nested_junk(draw, prompt),
            "shape": lambda: encode_like(
                form, draw(st.sampled_from([prompt[:-1], prompt[:, :1], prompt[..., :1], prompt[0]]))
            ),
            "text": lambda: draw(st.text(max_size=40)),
            "scalar": lambda: draw(
                st.one_of(
                    st.integers(),
                    st.floats(),
                    st.booleans(),
                    small_dict,
                )
            ),
        }[junk]()
        put(out, "prompt_routed_experts", value)
        return outputs, r, r"prompt_routed_experts|prompt part"
    # the prefix-cache count of the split form
    if form == "offline_split":
        put(out, "num_cached_tokens", draw(not_a_count.filter(lambda v: v is not None)))
        return outputs, r, "num_cached_tokens"
    where = draw(st.sampled_from(["usage", "details", "cached"]))
    junk = not_a_container
    if where == "usage":
        out["usage"] = draw(junk)
    elif where == "details":
        out["usage"]["prompt_tokens_details"] = draw(junk)
    else:
        out["usage"]["prompt_tokens_details"]["cached_tokens"] = draw(not_a_count.filter(lambda v: v is not None))
    return outputs, r, "usage|prompt_tokens_details|cached_tokens"


def refused(call: Any, engine: str, response: str, field: str) -> str:
    """Run `call`; it must raise a ValueError naming the engine, the response and (regex) the field."""
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{engine} "), message
    assert re.search(rf"\b{response}\b", message), message
    assert re.search(field, message, re.S), (field, message)
    return message


@FUZZ
@given(vllm_case())
def test_vllm_refuses_every_broken_output_naming_it(case):
    outputs, r, field = case
    refused(lambda: routes_from_vllm(outputs, LAYERS), "vLLM", f"output {r}", field)


@st.composite
def sglang_case(draw: st.DrawFn) -> tuple[list, int, str, int | None]:
    """Valid responses with response `r` broken one way, what the refusal must name besides the response, and the
    `num_layers` to import with (a list of LayerInfo needs it: SGLang's payload has no shape)."""
    form = draw(st.sampled_from(["native", "openai"]))
    n = draw(st.integers(1, 3))
    r = draw(st.integers(0, n - 1))
    responses = [sglang_response(form) for _ in range(n)]
    resp = responses[r]
    holder = resp["meta_info"] if form == "native" else resp["sglext"]  # the payload's dict
    counts = resp["meta_info"] if form == "native" else resp["usage"]
    num_layers = COLUMNS
    kinds = ["text", "bytes", "ids", "payload", "count", "wrong_count", "response"]
    kinds += ["start", "meta"] if form == "native" else ["usage", "sglext", "choices"]
    kind = draw(st.sampled_from(kinds))
    if kind == "text":  # at most 30 bytes: fewer than one position of 2 columns x K=2 x 4 bytes... x 6 positions
        holder["routed_experts"] = draw(st.text(max_size=40))
        return responses, r, "routed_experts", num_layers
    if kind == "bytes":  # never 6 positions x C columns x K=2 x 4 bytes for any C
        raw = draw(st.binary(max_size=300).filter(lambda b: len(b) % (ROWS * K * 4) or not b))
        holder["routed_experts"] = b64(raw)
        return responses, r, "routed_experts", num_layers
    if kind == "ids":
        array = good_routes().copy()
        p, col = draw(st.integers(0, ROWS - 1)), draw(st.sampled_from([0, 2]))
        if draw(st.booleans()):
            array[p, col, 1] = array[p, col, 0]
            match = "duplicate experts"
        else:
            value = draw(st.integers(-(2**31), -1) | st.integers(8, 2**31 - 1))
            array[p, col, 0] = value
            match = rf"expert id {value} outside"
        holder["routed_experts"] = b64(array.astype("<i4").tobytes())
        return responses, r, "routed_experts.*" + match, num_layers
    if kind == "payload":
        holder["routed_experts"] = draw(
            st.none() | not_a_container.filter(lambda v: not isinstance(v, str)) | small_dict
        )
        return responses, r, "routed_experts", num_layers
    if kind in ("count", "wrong_count"):
        field = draw(st.sampled_from(["prompt_tokens", "completion_tokens"]))
        if kind == "count":
            if draw(st.booleans()):
                del counts[field]
            else:
                counts[field] = draw(not_a_count)
            return responses, r, field, num_layers
        counts[field] = draw(st.integers(0, 12).filter(lambda v: v != (P if field == "prompt_tokens" else N)))
        return responses, r, r"positions", COLUMNS  # (read off the size, some wrong counts fit other columns)
    if kind == "response":
        responses[r] = draw(st.none() | not_a_container)
        return responses, r, "response dict", num_layers
    if kind == "start":
        start = draw(not_a_count.filter(lambda v: v is not None) | st.integers(ROWS + 1, 20) | st.integers(1, ROWS))
        resp["meta_info"]["routed_experts_start_len"] = start
        return responses, r, "routed_experts_start_len|positions", COLUMNS
    if kind == "meta":
        resp["meta_info"] = draw(st.none() | not_a_container)
        return responses, r, "meta_info", num_layers
    if kind == "usage":
        resp["usage"] = draw(st.none() | not_a_container)
        return responses, r, "usage", num_layers
    if kind == "sglext":
        resp["sglext"] = draw(st.none() | not_a_container)
        return responses, r, "sglext", num_layers
    if draw(st.booleans()):
        resp["choices"] = resp["choices"] * draw(st.integers(2, 3))
    else:
        resp["choices"] = draw(not_a_container.filter(lambda v: not isinstance(v, list)) | small_dict)
    return responses, r, "choices", num_layers


@FUZZ
@given(sglang_case())
def test_sglang_refuses_every_broken_response_naming_it(case):
    responses, r, field, num_layers = case
    refused(lambda: routes_from_sglang(responses, LAYERS, num_layers=num_layers), "SGLang", f"response {r}", field)


# -- anything anywhere: an import or a named refusal ------------------------------------------------------------------


def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key / index path into nested dicts and lists (the empty path: the object itself)."""
    found = [prefix]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        found += paths(value, (*prefix, key))
    return found


def replaced(obj: Any, path: tuple, value: Any, delete: bool) -> Any:
    """A deep copy of `obj` with `path` set to `value` (or its key deleted, when it is a dict's)."""
    if not path:
        return value
    obj = copy.deepcopy(obj)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


def imported_or_named(call: Any, engine: str, response: str) -> None:
    try:
        assert isinstance(call(), Routes)
    except ValueError as e:
        assert str(e).startswith(f"{engine} ") and re.search(rf"\b{response}\b", str(e)), str(e)


@st.composite
def json_case(draw: st.DrawFn, engine: str) -> tuple[list, int]:
    form = draw(st.sampled_from(["server", "split"] if engine == "vLLM" else ["native", "openai"]))
    items = [vllm_output(form) if engine == "vLLM" else sglang_response(form) for _ in range(2)]
    r = draw(st.integers(0, 1))
    path = draw(st.sampled_from(paths(items[r])))
    items[r] = replaced(items[r], path, draw(json_any), draw(st.booleans()))
    return items, r


@OPEN
@given(json_case("vLLM"))
def test_vllm_any_json_anywhere(case):
    outputs, r = case
    imported_or_named(lambda: routes_from_vllm(outputs, LAYERS), "vLLM", f"output {r}")


@OPEN
@given(json_case("SGLang"), st.just(COLUMNS))
def test_sglang_any_json_anywhere(case, num_layers):
    responses, r = case
    imported_or_named(lambda: routes_from_sglang(responses, LAYERS, num_layers=num_layers), "SGLang", f"response {r}")


any_array = npst.arrays(
    st.one_of(npst.scalar_dtypes(), npst.integer_dtypes(endianness="="), npst.unsigned_integer_dtypes()),
    npst.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7),
)


@OPEN
@given(any_array, st.sampled_from(["offline", "server"]), st.integers(0, 1))
def test_vllm_any_array(array, form, r):
    outputs = [vllm_output(form) for _ in range(2)]
    put(choice0(outputs[r]), "routed_experts", encode_like(form, array))
    imported_or_named(lambda: routes_from_vllm(outputs, LAYERS), "vLLM", f"output {r}")


@OPEN
@given(
    st.binary(max_size=200) | st.text(max_size=60),
    st.integers(-2, 10) | json_leaf,
    st.integers(-2, 10) | json_leaf,
    st.none() | st.integers(-2, 10) | json_leaf,
    st.just(COLUMNS),
)
def test_sglang_any_bytes_and_counts(payload, prompt, completion, start, num_layers):
    meta = {"prompt_tokens": prompt, "completion_tokens": completion}
    meta["routed_experts"] = b64(payload) if isinstance(payload, bytes) else payload
    if start is not None:
        meta["routed_experts_start_len"] = start
    responses = [sglang_response("native"), {"meta_info": meta}]
    imported_or_named(lambda: routes_from_sglang(responses, LAYERS, num_layers=num_layers), "SGLang", "response 1")


npy_descr = st.one_of(
    st.sampled_from(["<i4", "|u1", ">u2", "<f8", "|b1", "O", "<U2", "|V4", "<M8[s]", "<i9", "i", ""]),
    st.text(max_size=5),
    st.lists(st.tuples(st.text(max_size=2), st.sampled_from(["<i4", "|u1", "O"])), max_size=2),
    st.integers(),
)
npy_shape = st.one_of(
    st.tuples(*[st.integers(-2, 7)] * 3), st.lists(st.integers(-2, 2**62), max_size=4).map(tuple), json_leaf
)


@OPEN
@given(
    npy_descr,
    npy_shape,
    st.booleans() | json_leaf,
    st.binary(max_size=200),
    st.sampled_from([(1, 0), (2, 0), (3, 0), (9, 9)]),
)
def test_vllm_any_npy_header(descr, shape, fortran, data, version):
    """An `.npy` file whose header says anything: read only where it describes integer routes exactly."""
    header = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode("latin1", "replace") + b"\n"
    size = struct.pack("<H" if version[0] == 1 else "<I", len(header))
    outputs = [vllm_output("server") for _ in range(2)]
    choice0(outputs[1])["routed_experts"] = b64(b"\x93NUMPY" + bytes(version) + size + header + data)
    imported_or_named(lambda: routes_from_vllm(outputs, LAYERS), "vLLM", "output 1")
