"""Malformed engine payloads: each a ValueError naming the engine, the response and the field (never EOFError,
BadZipFile, ZeroDivisionError, numpy's unnamed messages or a TypeError), and ids checked before any cast."""

from __future__ import annotations

import base64
import io
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_payloads import (
    decoder_columns,
    pads,
    sglang_responses,
    vllm_outputs,
)

from moe_replay.integrations.sglang import routes_from_sglang
from moe_replay.integrations.vllm import routes_from_vllm


def server_split(gen):  # noqa: ANN001, ANN201
    """vLLM 0.21's server JSON: the split form's routes as nested lists."""
    out = []
    for o in vllm_outputs(gen, split=True):
        c = o.outputs[0]
        choice = {"index": 0, "token_ids": c.token_ids, "routed_experts": c.routed_experts.tolist()}
        out.append({"prompt_token_ids": o.prompt_token_ids, "prompt_routed_experts": o.prompt_routed_experts.tolist()})
        out[-1]["choices"] = [choice]
    return out


def openai_style(gen):  # noqa: ANN001, ANN201
    return [
        {
            "choices": [{"index": 0}],
            "usage": {k: r["meta_info"][k] for k in ("prompt_tokens", "completion_tokens")},
            "sglext": {"routed_experts": r["meta_info"]["routed_experts"]},
        }
        for r in sglang_responses(gen)
    ]


PAYLOADS = {
    "server": lambda g: vllm_outputs(g, np.uint8, server=True),
    "server_split": server_split,
    "offline": vllm_outputs,
    "offline_split": lambda g: vllm_outputs(g, split=True),
    "sglang": sglang_responses,
    "openai": openai_style,
}


def put(obj, key, value):  # noqa: ANN001, ANN201
    obj.__setitem__(key, value) if isinstance(obj, dict | list) else setattr(obj, key, value)


def choice(o, key, value):  # noqa: ANN001, ANN201
    """Set a field of output 1's first completion (a dict or an object)."""
    put(o[1]["choices"][0] if isinstance(o[1], dict) else o[1].outputs[0], key, value)


def routes(o, value):  # noqa: ANN001, ANN201
    choice(o, "routed_experts", value)


def meta(o, key, value):  # noqa: ANN001, ANN201
    o[1]["meta_info"][key] = value


def b64npy(array: np.ndarray, cut: int | None = None, extra: bytes = b"") -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return b64(buf.getvalue()[:cut] + extra)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def npz(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.savez(buf, routed_experts=array)
    return b64(buf.getvalue())


def full(gen, dtype=np.uint8, times: int = 1) -> np.ndarray:  # noqa: ANN001
    """Response 1's routes, one column per decoder layer (`times` over)."""
    return np.concatenate([decoder_columns(gen.rows[1].moe, dtype)] * times, axis=1)


def served(o) -> str:  # noqa: ANN001
    """Output 1's base64 routes (vLLM server) or response 1's (SGLang)."""
    return o[1]["choices"][0]["routed_experts"].decode() if "choices" in o[1] else o[1]["meta_info"]["routed_experts"]


def pr(o) -> list:  # noqa: ANN001
    return o[1]["prompt_routed_experts"]


def cr(o) -> list:  # noqa: ANN001
    return o[1]["choices"][0]["routed_experts"]


def N(gen) -> int:  # noqa: ANN001, N802
    """Response 1's completion tokens."""
    return len(gen.rows[1].completion)


def wide(o) -> np.ndarray:  # noqa: ANN001
    return o[1].outputs[0].routed_experts.astype(np.int32) + 65536


R = np.zeros((4, 3, 2), dtype=np.uint8)  # an array for the containers below
HEADER = b"{'descr': '|u1', 'fortran_order': False, 'shape': (1000000000000,)}\n"
HUGE = b"\x93NUMPY\x01\x00" + len(HEADER).to_bytes(2, "little") + HEADER  # 10**12 ids, none there
V, VS, S = "vLLM output 1, completion 0: ", "vLLM output 1: ", "SGLang response 1: "  # where the messages start
SPLIT = "vLLM output 1, completion 0, prompt_routed_experts + routed_experts: row 1, layer 'model.layers.0.mlp.gate'"
SGL, META = "SGLang response 1, meta_info['routed_experts']: ", S + "meta_info['routed_experts']"
MALFORMED = [  # (id, payload (/L: import with a list of LayerInfo), change to response 1, message fragment)
    ("empty", "server", lambda o, g: routes(o, ""), V + "routed_experts is empty"),
    ("not base64", "server", lambda o, g: routes(o, "@@" + served(o)), V + "routed_experts is not base64 (Only"),
    ("bad padding", "server", lambda o, g: routes(o, served(o)[:-1]), V + "routed_experts is not base64 (Incorrect"),
    ("npz", "server", lambda o, g: routes(o, npz(R)), V + "routed_experts is not base64 of an .npy file ("),
    ("zip", "server", lambda o, g: routes(o, b64(b"PK\x03\x04" + bytes(30))), V + "routed_experts is not base64 of an"),
    ("cut npy", "server", lambda o, g: routes(o, b64npy(R, -3)), "says (4, 3, 2) uint8 (24 bytes of data) but 21"),
    ("npy + bytes", "server", lambda o, g: routes(o, b64npy(full(g), extra=b"\0")), "(48 bytes of data) but 49 bytes"),
    ("npy of 10**12", "server", lambda o, g: routes(o, b64(HUGE)), "(1000000000000,) uint8 (1000000000000 bytes"),
    ("pickle", "server", lambda o, g: routes(o, b64npy(full(g, object))), V + "routed_experts holds object"),
    ("float npy", "server", lambda o, g: routes(o, b64npy(full(g, np.float32))), V + "routed_experts holds float32"),
    ("bool array", "offline", lambda o, g: routes(o, full(g, bool)), V + "routed_experts holds bool values (first:"),
    ("float tensor", "offline", lambda o, g: routes(o, torch.zeros(8, 3, 2)), V + "routed_experts holds torch.float32"),
    ("ragged", "server_split", lambda o, g: pr(o)[1].pop(), VS + "prompt_routed_experts[1] holds 1"),
    ("null row", "server_split", lambda o, g: pr(o).__setitem__(2, None), "[2] is None where a list of 2"),
    ("null id", "server_split", lambda o, g: pr(o)[0][1].__setitem__(0, None), "[0][1][0] is None, not an"),
    ("float lists", "server_split", lambda o, g: cr(o)[0][0].__setitem__(1, 2.5), V + "routed_experts[0][0][1] is 2.5"),
    ("past int16", "offline_split", lambda o, g: routes(o, wide(o)), SPLIT),
    ("null count", "server", lambda o, g: choice(o, "token_ids", None), "vLLM output 1, completion 0 has no token_ids"),
    ("str count", "server", lambda o, g: choice(o, "token_ids", "x" * N(g)), V + "token_ids must be a list of token"),
    ("float index", "server", lambda o, g: choice(o, "index", 1.5), V + "index must be a whole number, got 1.5"),
    ("index 0 twice", "server", lambda o, g: o[1]["choices"].append(o[1]["choices"][0]), VS + "two of its completions"),
    ("choices an int", "server", lambda o, g: put(o[1], "choices", 5), VS + "choices must be a list of completions"),
    ("null output", "server", lambda o, g: put(o, 1, None), "vLLM output 1 is None, not a RequestOutput or a response"),
    ("usage a list", "server_split", lambda o, g: put(o[1], "usage", []), VS + "usage must be a dict, got []"),
    ("cached a list", "offline_split", lambda o, g: put(o[1], "num_cached_tokens", [2]), VS + "num_cached_tokens must"),
    (
        "columns differ",
        "offline/L",
        lambda o, g: routes(o, full(g, times=2)),
        "6 layer columns, but those of vLLM output 0",
    ),
    ("sglang empty", "sglang/L", lambda o, g: meta(o, "routed_experts", ""), META + " is empty"),
    ("sglang not base64", "sglang", lambda o, g: meta(o, "routed_experts", "@" + served(o)), META + " is not base64 ("),
    ("sglang padding", "sglang", lambda o, g: meta(o, "routed_experts", served(o)[:-2]), META + " is not base64 ("),
    ("sglang ASCII", "sglang", lambda o, g: meta(o, "routed_experts", "é" + served(o)), "holds 'é' at character 0"),
    ("sglang part row", "sglang/L", lambda o, g: meta(o, "routed_experts", b64(bytes(22))), SGL + "22 bytes of routes"),
    ("sglang null count", "sglang", lambda o, g: meta(o, "prompt_tokens", None), "['prompt_tokens'] must be a whole"),
    (
        "sglang float count",
        "sglang",
        lambda o, g: meta(o, "completion_tokens", N(g) + 0.5),
        "tokens'] must be a whole number",
    ),
    ("sglang inf count", "sglang", lambda o, g: meta(o, "completion_tokens", float("inf")), "a whole number, got inf"),
    ("sglang float start", "sglang", lambda o, g: meta(o, "routed_experts_start_len", 0.5), "start_len'] must be a"),
    ("sglang null response", "sglang", lambda o, g: put(o, 1, None), "SGLang response 1 is None, not a response dict"),
    ("sglang meta a list", "sglang", lambda o, g: put(o[1], "meta_info", []), S + "meta_info must be a dict, got []"),
    ("sglang usage a list", "openai", lambda o, g: put(o[1], "usage", [3, 4]), S + "usage must be a dict, got [3, 4]"),
    ("sglang sglext a str", "openai", lambda o, g: put(o[1], "sglext", "x"), S + "sglext must be a dict, got 'x'"),
    ("sglang choices int", "openai", lambda o, g: put(o[1], "choices", 2), S + "choices must be a list, got 2"),
    ("sglang columns differ", "sglang/L", lambda o, g: meta(o, "routed_experts", b64(full(g, "<i4", 2).data)), SGL),
]


@pytest.mark.parametrize("form, change, fragment", [case[1:] for case in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_payloads_name_the_engine_the_response_and_the_field(generation, form, change, fragment):
    """Each failure class of issue 44 (EOFError, BadZipFile, MemoryError, ZeroDivisionError, TypeError,
    AttributeError, numpy's own messages, or silent truncation and wrapping before): refused naming all three."""
    form, _, layers = form.partition("/")
    payload = PAYLOADS[form](generation)
    change(payload, generation)
    sglang = form in ("sglang", "openai")
    importer = routes_from_sglang if sglang else routes_from_vllm
    # (with a list of LayerInfo, SGLang's shapeless payload needs the column count: test_sglang_needs_the_column_count)
    extra = {"num_layers": generation.model.config.num_hidden_layers} if sglang and layers else {}
    with pytest.raises(ValueError, match=re.escape(fragment)):
        importer(payload, generation.routes.layers if layers else generation.model, **extra)


def test_sglang_needs_the_column_count_with_a_list_of_layer_info(generation):
    """SGLang's payload has no shape: read off its size, a start_len off by one re-read 5 positions x 4 columns as
    4 x 5, every id misplaced, no error (found by review). With a list of LayerInfo, `num_layers` is needed."""
    g = generation
    responses = PAYLOADS["sglang"](g)
    with pytest.raises(ValueError, match=r"a list of LayerInfo does not say how many decoder layers .* num_layers="):
        routes_from_sglang(responses, g.routes.layers, pad_left=pads(g))
    got = routes_from_sglang(responses, g.routes.layers, pad_left=pads(g), num_layers=g.model.config.num_hidden_layers)
    assert got.equal(routes_from_sglang(responses, g.model, pad_left=pads(g)))
    with pytest.raises(
        ValueError, match=r"SGLang response 0, .*routes hold \d+ positions but .* - routed_experts_start"
    ):
        routes_from_sglang(responses, g.routes.layers, num_layers=g.model.config.num_hidden_layers, start_len=1)


def test_ids_are_checked_before_any_cast_and_errors_name_the_response(generation):
    """Found by fuzzing (issue 44): vLLM's split form cast the completion's routes to the prompt's dtype (int32 ids
    past int16 wrapped; float lists were truncated) and its prefix-cache marking cast the prompt's to int32 (2**32 + 3
    read as 3); uint64 ids past int64 wrapped to negatives, an all-negative position then left silently unrecorded.
    Routes.from_rows's "row i" is the response's completion: with n > 1 row 2 is output 1's first completion."""
    g = generation
    outputs = vllm_outputs(g, split=True)
    outputs[1].num_cached_tokens = None
    prompt = outputs[1].prompt_routed_experts.astype(np.int64)
    prompt[0], prompt[1, 0, 0] = 0, 2**32 + 3  # a leading cached (zero) position, then an id narrowing would wrap to 3
    outputs[1].prompt_routed_experts = prompt
    with pytest.raises(ValueError, match=re.escape(SPLIT) + r" .*expert id 4294967299 outside"):
        routes_from_vllm(outputs, g.model)
    outputs = vllm_outputs(g)
    outputs[0].outputs[0].routed_experts = outputs[0].outputs[0].routed_experts.astype(np.uint64)
    outputs[0].outputs[0].routed_experts[2] = 2**64 - 1
    with pytest.raises(ValueError, match="output 0, completion 0: routed_experts: expert id 18446744073709551615 does"):
        routes_from_vllm(outputs, g.model)
    outputs = vllm_outputs(g)
    outputs[0].outputs.append(SimpleNamespace(**{**vars(outputs[0].outputs[0]), "index": 1}))
    outputs[1].outputs[0].routed_experts[3, 2, 0] = 8
    with pytest.raises(ValueError, match="vLLM output 1, completion 0, routed_experts: row 2, layer 'model.layers.2"):
        routes_from_vllm(outputs, g.model)
    responses = sglang_responses(g)
    ids = np.frombuffer(base64.b64decode(responses[3]["meta_info"]["routed_experts"]), "<i4").copy()
    ids[7] = ids[6]  # position 1, layer 0: one expert twice
    responses[3]["meta_info"]["routed_experts"] = b64(ids.tobytes())
    with pytest.raises(
        ValueError, match=r"SGLang response 3, meta_info\['routed_experts'\]: duplicate experts .* at sequence 3"
    ):
        routes_from_sglang(responses, g.model)
