"""What the newest engines return (docs/engines.md): vLLM 0.33's `routed_experts_prompt_start` and SGLang's
`routed_experts_start_len` (neither echoed in the output: given to the importer), SGLang's per-choice `meta_info`,
megatron-core's inference engine in its three forms, requests without routes named by their cause, and T defaulting
to the batch length the token counts give (so a replay on the generated batch needs no `seq_len`)."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_payloads import decoder_columns, imported_equal, pads, sglang_responses, vllm_outputs

from moe_replay import Routes
from moe_replay.integrations.megatron_inference import routes_from_megatron_inference
from moe_replay.integrations.sglang import routes_from_sglang
from moe_replay.integrations.vllm import routes_from_vllm


def skipped(gen, starts: list[int]) -> Routes:  # noqa: ANN001
    """The recording with each row's first `starts[i]` prompt positions unrecorded."""
    mask = gen.routes.mask.clone()
    for i, (r, s) in enumerate(zip(gen.rows, starts, strict=True)):
        mask[i, r.pad : r.pad + s] = False
    return Routes(gen.routes.indices, mask, gen.routes.layers)


def test_the_batch_length_comes_from_the_token_counts(generation):
    """Without seq_len the routes are as long as the generated batch (prompt + completion tokens), not one shorter
    (the last sampled token has no route), so they replay on it as they are."""
    for routes in (
        routes_from_vllm(vllm_outputs(generation), generation.model, pad_left=pads(generation)),
        routes_from_sglang(sglang_responses(generation), generation.model, pad_left=pads(generation)),
    ):
        assert routes.seq_len == generation.sequences.shape[1]
        imported_equal(generation, routes)


def vllm_started(gen, starts: list[int], server: bool) -> list:  # noqa: ANN001
    """vLLM outputs of requests sent with routed_experts_prompt_start = starts[i]: prompt + completion - 1 - s
    rows each (uint8, as vLLM returns them at <= 256 experts)."""
    outputs = []
    for r, s in zip(gen.rows, starts, strict=True):
        part = decoder_columns(r.moe, np.uint8)[s:]
        if server:
            buf = io.BytesIO()
            np.save(buf, part)
            choice = {
                "index": 0,
                "token_ids": r.completion,
                "routed_experts": base64.b64encode(buf.getvalue()).decode(),
            }
            outputs.append({"prompt_token_ids": r.prompt, "choices": [choice]})
        else:
            choice = SimpleNamespace(index=0, token_ids=r.completion, routed_experts=part)
            outputs.append(SimpleNamespace(prompt_token_ids=r.prompt, prompt_routed_experts=None, outputs=[choice]))
    return outputs


@pytest.mark.parametrize("server", [False, True])
def test_vllm_prompt_start_places_the_rows_and_leaves_the_skipped_positions_unrecorded(generation, server):
    starts = [1, 0, 2, 3]
    outputs = vllm_started(generation, starts, server)
    routes = routes_from_vllm(outputs, generation.model, pad_left=pads(generation), prompt_start=starts)
    assert routes.equal(skipped(generation, starts))
    outputs = vllm_started(generation, [2] * 4, server)  # one start for every request
    routes = routes_from_vllm(outputs, generation.model, pad_left=pads(generation), prompt_start=2)
    assert routes.equal(skipped(generation, [2] * 4))


def test_vllm_offsets_and_aborted_requests_are_named(generation):
    r = generation.rows[0]
    out = vllm_outputs(generation)[:1]
    with pytest.raises(ValueError, match=f"prompt_start=9 is past its prompt of {len(r.prompt)} tokens"):
        routes_from_vllm(out, generation.model, prompt_start=9)
    need = len(r.prompt) + len(r.completion) - 1 - 2
    with pytest.raises(ValueError, match=f"completion tokens need prompt \\+ completion - 1 - prompt_start 2 = {need}"):
        routes_from_vllm(out, generation.model, prompt_start=2)  # (whole rows sent: the start was not asked for)
    with pytest.raises(ValueError, match="prompt_start has 2 offsets for 1 requests"):
        routes_from_vllm(out, generation.model, prompt_start=[0, 1])
    with pytest.raises(ValueError, match="prompt_start must hold whole numbers >= 0, got -1"):
        routes_from_vllm(out, generation.model, prompt_start=-1)
    for bad in (True, 2.0, "2"):
        with pytest.raises(ValueError, match="prompt_start must be a whole number or one per request, got"):
            routes_from_vllm(out, generation.model, prompt_start=bad)
    with pytest.raises(ValueError, match="split form \\(prompt_routed_experts\\), which always covers the whole"):
        routes_from_vllm(vllm_outputs(generation, split=True)[:1], generation.model, prompt_start=1)
    aborted = vllm_outputs(generation)[:1]
    aborted[0].outputs[0].routed_experts, aborted[0].outputs[0].finish_reason = None, "abort"
    with pytest.raises(ValueError, match="completion 0 was aborted before any forward: it holds no routed_experts"):
        routes_from_vllm(aborted, generation.model)


def test_sglang_start_len_given_or_echoed(generation):
    starts = [2, 0, 1, 3]
    responses = sglang_responses(generation)
    for resp, r, s in zip(responses, generation.rows, starts, strict=True):
        resp["meta_info"]["routed_experts"] = base64.b64encode(decoder_columns(r.moe, np.int32)[s:].tobytes()).decode()
    expected = skipped(generation, starts)
    assert routes_from_sglang(responses, generation.model, pad_left=pads(generation), start_len=starts).equal(expected)
    for resp, s in zip(responses, starts, strict=True):  # an engine that echoes it
        resp["meta_info"]["routed_experts_start_len"] = s
    assert routes_from_sglang(responses, generation.model, pad_left=pads(generation)).equal(expected)
    with pytest.raises(ValueError, match="response 1: start_len=2 was given but meta_info says routed_experts_st"):
        routes_from_sglang(responses, generation.model, start_len=2)
    with pytest.raises(ValueError, match="start_len has 3 offsets for 4 requests"):
        routes_from_sglang(responses, generation.model, start_len=[0, 0, 0])


def test_sglang_per_choice_meta_info_gives_one_row_per_choice(generation):
    """`return_meta_info=true` on an OpenAI-style request: each choice carries its own meta_info (counts and
    routes), which lifts the one-choice limit of the `usage` form."""
    native = sglang_responses(generation)
    response = {"choices": [{"index": j, "meta_info": resp["meta_info"]} for j, resp in enumerate(native)]}
    routes = routes_from_sglang([response], generation.model, pad_left=pads(generation))
    imported_equal(generation, routes)
    del response["choices"][2]["meta_info"]["routed_experts"]
    with pytest.raises(ValueError, match="SGLang response 0, choice 2 has no meta_info\\['routed_experts'\\]"):
        routes_from_sglang([response], generation.model)


def megatron_requests(gen, form: str) -> list:  # noqa: ANN001
    """The generation as megatron-core's inference engine returns it: requests, records, serialized, server."""
    out = []
    for r in gen.rows:
        routes = r.moe.numpy().astype(np.int16)  # one column per MoE layer
        if form == "request":
            out.append(SimpleNamespace(prompt_tokens=torch.tensor(r.prompt), generated_tokens=r.completion,
                                       routing_indices=routes))  # fmt: skip
        elif form == "record":
            merged = SimpleNamespace(prompt_tokens=torch.tensor(r.prompt), generated_tokens=r.completion,
                                     routing_indices=routes)  # fmt: skip
            out.append(SimpleNamespace(requests=[merged], merge=lambda merged=merged: merged))
        elif form == "serialized":  # the prompt dropped (the default), its length kept
            out.append({"prompt_tokens": None, "prompt_length": len(r.prompt), "generated_tokens": r.completion,
                        "routing_indices": ("ndarray", {"data": routes.tolist(), "dtype": "int16"})})  # fmt: skip
        else:
            choice = {"index": 0, "prompt_token_ids": r.prompt, "generation_token_ids": r.completion,
                      "moe_topk_indices": ["ndarray", {"data": routes.tolist(), "dtype": "int16"}]}  # fmt: skip
            out.append({"choices": [choice]})
    return out


@pytest.mark.parametrize("form", ["request", "record", "serialized", "server"])
def test_megatron_inference_routes_import(generation, form):
    routes = routes_from_megatron_inference(
        megatron_requests(generation, form), generation.model, pad_left=pads(generation)
    )
    imported_equal(generation, routes)


def test_megatron_inference_errors_name_the_request_and_the_cause(generation):
    requests = megatron_requests(generation, "request")
    requests[1].routing_indices = None
    with pytest.raises(ValueError, match="request 1 holds no routing_indices: .* neither evicted nor resumed"):
        routes_from_megatron_inference(requests, generation.model)
    requests = megatron_requests(generation, "request")
    requests[2].routing_indices = requests[2].routing_indices[:-1]
    with pytest.raises(ValueError, match="request 2, routing_indices: routes hold .* positions but its"):
        routes_from_megatron_inference(requests, generation.model)
    serialized = megatron_requests(generation, "serialized")
    serialized[0]["routing_indices"][1]["dtype"] = "float32"
    with pytest.raises(
        ValueError, match="request 0, routing_indices: routes must hold integer expert ids, got dtype float32"
    ):
        routes_from_megatron_inference(serialized, generation.model)
    serialized = megatron_requests(generation, "serialized")
    serialized[0]["routing_indices"] = ("ndarray", {"data": [[[300, 1]]], "dtype": "int8"})
    with pytest.raises(ValueError, match="ids outside the range of the stated dtype int8"):
        routes_from_megatron_inference(serialized, generation.model)
    del serialized[1]["prompt_length"]
    with pytest.raises(ValueError, match="request 1 holds neither prompt_tokens nor prompt_length"):
        routes_from_megatron_inference(
            megatron_requests(generation, "serialized")[:1] + serialized[1:2], generation.model
        )
    with pytest.raises(ValueError, match="megatron-core request 0 is 'x', not a request"):
        routes_from_megatron_inference(["x"], generation.model)
