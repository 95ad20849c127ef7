"""vLLM and SGLang routes imported as `Routes`: payloads built from moe-replay's own recording of a tiny model
(3 decoder layers, layer 1 dense, 8 experts, top-2) and encoded exactly as each engine encodes them (docs/engines.md),
then imported and compared with the recording; every error names both sides. No engine runs here."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_payloads import (
    DECODER_LAYERS,
    decoder_columns,
    imported_equal,
    pads,
    sglang_responses,
    vllm_outputs,
)
from helpers import tiny_qwen3_moe

from moe_replay import LayerInfo, Routes, record_routes
from moe_replay.integrations.sglang import routes_from_sglang
from moe_replay.integrations.vllm import routes_from_vllm


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.uint16])
def test_vllm_per_completion_offline(generation, dtype):
    T = generation.routes.seq_len
    imported_equal(
        generation,
        routes_from_vllm(vllm_outputs(generation, dtype), generation.model, pad_left=pads(generation), seq_len=T),
    )


def test_vllm_split_form_and_server_forms(generation):
    g, T = generation, generation.routes.seq_len
    imported_equal(g, routes_from_vllm(vllm_outputs(g, split=True), g.model, pad_left=pads(g), seq_len=T))
    imported_equal(g, routes_from_vllm(vllm_outputs(g, np.uint8, server=True), g.model, pad_left=pads(g), seq_len=T))


def test_vllm_prefix_cached_prompt_rows_are_unrecorded(generation):
    """vLLM 0.21 leaves prompt rows served from its prefix cache zero (or -1): those positions route live."""
    g = generation
    outputs = vllm_outputs(g, split=True)
    outputs[0].prompt_routed_experts[:2] = 0
    outputs[1].prompt_routed_experts[:1] = -1
    routes = routes_from_vllm(outputs, g.model, pad_left=pads(g), seq_len=g.routes.seq_len)
    expected = g.routes.mask.clone()
    expected[0, g.rows[0].pad : g.rows[0].pad + 2] = False
    expected[1, g.rows[1].pad] = False
    assert torch.equal(routes.mask, expected)
    m = expected
    assert torch.equal(routes.indices.long().sort(-1).values[m], g.routes.indices.long().sort(-1).values[m])


@pytest.mark.parametrize("told", [True, False], ids=["num_cached_tokens", "leading_zeros"])
def test_vllm_prefix_cached_prompt_rows_of_a_top_1_model_are_unrecorded(told):
    """At K = 1 an all-zero position may be a real route (expert 0 in every layer), so zeros anywhere cannot mark
    the positions vLLM served from its prefix cache: the first `num_cached_tokens` zero positions are left unrecorded
    (without it, the leading run of them), a real route to expert 0 later in the prompt is kept (found by review:
    cached positions were replayed as expert 0)."""
    model = tiny_qwen3_moe(top_k=1)
    ids = torch.tensor([[5, 9, 11, 3, 6, 8]])
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    prompt_routes = rec.routes.indices[0].numpy().astype(np.int16)  # [6, L, 1]
    prompt_routes[:3] = 0  # served from the prefix cache
    prompt_routes[4] = 0  # a real route to expert 0 in every layer
    completion = SimpleNamespace(index=0, token_ids=[7], routed_experts=np.zeros((0, *prompt_routes.shape[1:])))
    output = SimpleNamespace(
        prompt_token_ids=ids[0].tolist(), prompt_routed_experts=prompt_routes, outputs=[completion]
    )
    if told:
        output.num_cached_tokens = 3
    routes = routes_from_vllm([output], model)
    assert routes.mask[0].tolist() == [False, False, False, True, True, True, False]  # (T: the 7 tokens)
    assert torch.equal(routes.indices[0, 3:6].long(), torch.from_numpy(prompt_routes[3:]).long())


def test_vllm_n_completions_per_request_keep_index_order(generation):
    """n > 1: the completions of one request become consecutive rows in CompletionOutput.index order."""
    r = generation.rows[0]
    first = decoder_columns(r.moe, np.int32)
    second = first.copy()
    second[:, 0] = (second[:, 0] + 1) % 8  # other (still distinct) experts in layer 0
    choices = [
        SimpleNamespace(index=1, token_ids=r.completion, routed_experts=second),
        SimpleNamespace(index=0, token_ids=r.completion, routed_experts=first),
    ]
    request = SimpleNamespace(prompt_token_ids=r.prompt, prompt_routed_experts=None, outputs=choices)
    routes = routes_from_vllm([request], generation.model)
    assert routes.shape[:2] == (2, len(r.prompt) + len(r.completion))  # (T: the batch length the token counts give)
    assert torch.equal(routes.indices[0, :-1, 0].long(), torch.from_numpy(first[:, 0]).long())
    assert torch.equal(routes.indices[1, :-1, 0].long(), torch.from_numpy(second[:, 0]).long())


def test_sglang(generation):
    g = generation
    imported_equal(g, routes_from_sglang(sglang_responses(g), g.model, pad_left=pads(g), seq_len=g.routes.seq_len))
    # with a list of LayerInfo, the column count is given (the payload has no shape)
    columns = g.model.config.num_hidden_layers
    routes = routes_from_sglang(
        sglang_responses(g), g.routes.layers, pad_left=pads(g), seq_len=g.routes.seq_len, num_layers=columns
    )
    assert routes.equal(g.routes)


def npy_base64(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue())


def test_vllm_completions_endpoint_one_response_for_all_prompts(generation):
    """/v1/completions gives each choice its prompt's ids, and a response may hold several prompts' choices: it was
    refused for lacking a top-level prompt_token_ids (found by review). One response, or one RequestOutput, may also
    come alone, not in a list (it was read as a list of its keys)."""
    g, T = generation, generation.routes.seq_len
    choices = [
        {"index": i, "prompt_token_ids": r.prompt, "token_ids": r.completion,
         "routed_experts": npy_base64(decoder_columns(r.moe, np.uint8))}
        for i, r in enumerate(g.rows)
    ]  # fmt: skip
    imported_equal(g, routes_from_vllm({"choices": choices[::-1]}, g.model, pad_left=pads(g), seq_len=T))
    alone = routes_from_vllm(vllm_outputs(g)[1], g.model, pad_left=pads(g)[1:2], seq_len=T)
    assert alone.equal(g.routes[1:2])
    responses = sglang_responses(g)
    assert routes_from_sglang(responses[2], g.model, pad_left=pads(g)[2:3], seq_len=T).equal(g.routes[2:3])


def test_vllm_split_form_of_a_one_token_completion(generation):
    """A completion of one token has no completion rows: the server's `routed_experts` is `[]` (found by review: it
    was refused as not [positions, layers, K]); its prompt's routes are imported."""
    r = generation.rows[0]
    prompt_routes = r.moe[: len(r.prompt)].numpy().astype(np.int16)
    response = {
        "prompt_token_ids": r.prompt,
        "prompt_routed_experts": prompt_routes.tolist(),
        "choices": [{"index": 0, "token_ids": [7], "routed_experts": []}],
    }
    routes = routes_from_vllm([response], generation.model, pad_left=[r.pad], seq_len=generation.routes.seq_len)
    assert routes.mask[0].nonzero().flatten().tolist() == list(range(r.pad, r.pad + len(r.prompt)))
    assert torch.equal(
        routes.indices[0, r.pad : r.pad + len(r.prompt)], generation.routes.indices[0, r.pad :][: len(r.prompt)]
    )


def test_sglang_openai_style_response_counts_tokens_in_usage(generation):
    """SGLang's OpenAI-compatible endpoints put the routes in `sglext` and the token counts in `usage`, with no
    meta_info (found by review: refused for lacking meta_info's counts, though documented as accepted)."""
    g, T = generation, generation.routes.seq_len
    responses = [
        {
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}}],
            "usage": {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.completion)},
            "sglext": {"routed_experts": base64.b64encode(decoder_columns(r.moe, np.int32).tobytes()).decode()},
        }
        for r in g.rows
    ]
    imported_equal(g, routes_from_sglang(responses, g.model, pad_left=pads(g), seq_len=T))
    responses[0]["choices"] *= 2
    with pytest.raises(ValueError, match="response 0 holds 2 choices: .* counts their completion tokens together"):
        routes_from_sglang(responses, g.model, pad_left=pads(g), seq_len=T)


def test_importing_with_the_model_inside_its_open_context_is_refused(generation):
    """The importers learn a Hugging Face model's layers by one forward, which an open recording recorded as a batch
    of its own (found by review: a phantom row shifted every later one); the layers can be passed instead."""
    g = generation
    with record_routes(g.model) as rec:
        with pytest.raises(ValueError, match="import before opening the context, or pass the layers"):
            routes_from_vllm(vllm_outputs(g), g.model, pad_left=pads(g))
        imported = routes_from_vllm(vllm_outputs(g), g.routes.layers, pad_left=pads(g), seq_len=g.routes.seq_len)
        g.model(g.sequences[:1, :3])
    assert rec.routes.batch_size == 1 and imported.equal(g.routes)


def test_from_rows_places_rows_at_their_offsets():
    rows = [np.array([[[0, 1]], [[2, 3]]], dtype=np.int32), torch.tensor([[[1, 2]]])]
    r = Routes.from_rows(rows, [LayerInfo("model.layers.0.mlp.gate", 4, 2)], pad_left=[1, 0], seq_len=4)
    assert r.mask.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert r.indices[0, 2, 0].tolist() == [2, 3] and r.indices.dtype == torch.uint8
    with pytest.raises(ValueError, match="row 0 .2 positions from offset 3. does not fit T=4"):
        Routes.from_rows(rows, [LayerInfo("model.layers.0.mlp.gate", 4, 2)], pad_left=[3, 0], seq_len=4)


def test_from_rows_refuses_layers_it_cannot_hold_and_keeps_rows_without_routes():
    """Found by review: layers of different K, a repeated name, or two layers naming one decoder layer's engine
    column were accepted (the last two got one column's routes each); a row with no real route crashed."""
    gate = LayerInfo("model.layers.0.mlp.gate", 4, 2)
    row = np.array([[[0, 1], [2, 3]]], dtype=np.int32)
    with pytest.raises(ValueError, match="has top_k=1 but layer 'model.layers.0.mlp.gate' has top_k=2"):
        Routes.from_rows([row], [gate, LayerInfo("model.layers.1.mlp.gate", 4, 1)])
    with pytest.raises(ValueError, match="'model.layers.0.mlp.gate' appears 2 times"):
        Routes.from_rows([row], [gate, gate])
    two = [LayerInfo("model.layers.1.self_attn.router", 4, 2), LayerInfo("model.layers.1.mlp.router", 4, 2)]
    with pytest.raises(ValueError, match="all name decoder layer 1"):
        Routes.from_rows([np.zeros((1, 3, 2), dtype=np.int32)], two)
    empty = np.full((2, 1, 2), -1, dtype=np.int32)
    r = Routes.from_rows([empty, np.array([[[0, 1]]], dtype=np.int32)], [gate], seq_len=2)
    assert r.mask.tolist() == [[False, False], [True, False]]
    with pytest.raises(ValueError, match=r"whole numbers of positions, got \[1.7\]"):
        Routes.from_rows([row[:, :1]], [gate], pad_left=[1.7])
    # found by review: wider unsigned ids and big-endian arrays crashed in torch, and columns out of range raised
    # torch's own RuntimeError
    for given in (
        row.astype(np.uint32),
        row.astype(np.uint64),
        row.astype(">i4"),
        torch.from_numpy(row).to(torch.uint16),
    ):
        assert Routes.from_rows([given], [gate, LayerInfo("model.layers.1.mlp.gate", 4, 2)]).equal(
            Routes.from_rows([row], [gate, LayerInfo("model.layers.1.mlp.gate", 4, 2)])
        )
    for columns in ([0, 5], [0, -1]):
        with pytest.raises(ValueError, match=r"columns \[0, -?\d\] name columns outside the rows' 2 layer columns"):
            Routes.from_rows([row], [gate, LayerInfo("model.layers.1.mlp.gate", 4, 2)], columns=columns)


def test_errors_name_both_sides(generation):
    g = generation
    outputs = vllm_outputs(g)
    outputs[0].outputs[0].routed_experts = np.concatenate(
        [outputs[0].outputs[0].routed_experts[:1]] * 2 + [outputs[0].outputs[0].routed_experts[1:]]
    )
    n = len(g.rows[0].prompt) + len(g.rows[0].completion) - 1
    with pytest.raises(ValueError, match=f"routes hold {n + 1} positions but .* need prompt \\+ completion - 1 = {n}"):
        routes_from_vllm(outputs, g.model)
    outputs = vllm_outputs(g)
    outputs[2].outputs[0].routed_experts = None
    with pytest.raises(ValueError, match="no routed_experts: start vLLM with enable_return_routed_experts=True"):
        routes_from_vllm(outputs, g.model)
    outputs = vllm_outputs(g)
    outputs[0].outputs[0].routed_experts = np.zeros((n, 4, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="routes for 4 layers but the model has 2 MoE layers and 3 decoder layers"):
        routes_from_vllm(outputs, g.model)
    outputs = vllm_outputs(g)
    outputs[0].outputs[0].routed_experts = outputs[0].outputs[0].routed_experts[..., :1]
    with pytest.raises(ValueError, match="K=1 experts per token but the layers have top_k=2"):
        routes_from_vllm(outputs, g.model)
    outputs = vllm_outputs(g)
    outputs[1].outputs[0].routed_experts[3, 2, 0] = 8
    with pytest.raises(
        ValueError, match="row 1, layer 'model.layers.2.mlp.gate' .engine column 2.: expert id 8 outside .0, E=8."
    ):
        routes_from_vllm(outputs, g.model)
    outputs = vllm_outputs(g)
    routes = outputs[1].outputs[0].routed_experts
    routes[3, 2, 0] = routes[3, 2, 1]
    with pytest.raises(
        ValueError, match="duplicate experts .* at sequence 1, position 3, layer 'model.layers.2.mlp.gate'"
    ):
        routes_from_vllm(outputs, g.model)
    responses = sglang_responses(g)
    responses[0]["meta_info"]["routed_experts"] = base64.b64encode(b"\0" * 20).decode()
    with pytest.raises(ValueError, match="20 bytes of routes are not a multiple of L x K x 4 = 3 x 2 x 4"):
        routes_from_sglang(responses, g.model)
    del responses[1]["meta_info"]["routed_experts"]
    with pytest.raises(
        ValueError,
        match="response 0 has no meta_info.'routed_experts'.: launch SGLang with --enable-return-routed-experts",
    ):
        routes_from_sglang(responses[1:], g.model)


def test_sglang_routed_experts_start_len(generation):
    """A request with routed_experts_start_len=s returns positions s .. seq_len - 2: the first s stay unrecorded."""
    g = generation
    responses = sglang_responses(g)
    meta = responses[2]["meta_info"]
    full = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, DECODER_LAYERS, 2)
    meta["routed_experts"] = base64.b64encode(full[3:].tobytes()).decode()
    meta["routed_experts_start_len"] = 3
    routes = routes_from_sglang(responses, g.model, pad_left=pads(g), seq_len=g.routes.seq_len)
    expected = g.routes.mask.clone()
    expected[2, g.rows[2].pad : g.rows[2].pad + 3] = False
    assert torch.equal(routes.mask, expected)
    assert torch.equal(routes.indices[expected], g.routes.indices[expected])


def test_vllm_routes_know_each_rows_tokens_through_selection_and_moves(generation):
    """`routes_from_vllm` hands on each row's prompt + completion ids (an `EngineRoutes`), so a consumer can check the
    rows sit on their own tokens; selecting rows keeps theirs, joining or padding gives plain Routes, and an output
    that gives only token counts has none to check."""
    from moe_replay.integrations.engine_routes import EngineRoutes

    g = generation
    routes = routes_from_vllm(vllm_outputs(g), g.model)
    rows = [tuple(r.prompt) + tuple(r.completion) for r in g.rows]
    assert isinstance(routes, EngineRoutes) and routes.tokens == tuple(rows)
    B = len(rows)
    every_other = torch.arange(B) % 2 == 0
    for idx, picked in (
        ([2, 0], [2, 0]),
        (slice(1, None), list(range(1, B))),
        (-1, [B - 1]),
        (every_other, list(range(0, B, 2))),
    ):
        part = routes[idx]
        assert isinstance(part, EngineRoutes) and part.tokens == tuple(rows[i] for i in picked)
        assert part.equal(Routes(routes.indices[picked], routes.mask[picked], routes.layers))
    assert routes.to("cpu").tokens == routes.tokens
    assert type(Routes.cat([routes, routes])) is Routes and type(routes.pad_to(routes.seq_len + 1)) is Routes
    prompts, completions = [r.prompt for r in g.rows], [r.completion for r in g.rows]
    routes.check_rows(prompts, completions, "here")
    routes.check_rows(prompts, [c[:1] for c in completions], "here")  # (a completion cut after its end token)
    with pytest.raises(ValueError, match=r"here: row 0 was imported for other tokens .* differ at position"):
        routes[[1, 0, *range(2, B)]].check_rows(prompts, completions, "here")
    counted = vllm_outputs(g)
    for out in counted:
        out.prompt_token_ids = len(out.prompt_token_ids)  # a count, not the ids
    assert routes_from_vllm(counted, g.model).tokens == (None,) * len(g.rows)
    routes_from_vllm(counted, g.model).check_rows(prompts[::-1], completions[::-1], "here")  # (nothing to check)


def test_an_all_zero_top_1_payload_warns_naming_the_likely_cause():
    """vLLM's routing buffer holds zeros where the capture never ran: with K = 1 such a payload passes every check
    (with K > 1 it is refused as duplicates), so it warns, naming the flag; a payload with any other id does not."""
    import warnings

    layers = [LayerInfo("model.layers.0.mlp.gate", 4, 1), LayerInfo("model.layers.1.mlp.gate", 4, 1)]
    zeros = np.zeros((5, 2, 1), dtype=np.uint8)
    output = SimpleNamespace(prompt_token_ids=[3, 4, 5], outputs=[SimpleNamespace(index=0, token_ids=[6, 7, 8],
                             routed_experts=zeros)])  # fmt: skip
    with pytest.warns(UserWarning, match=r"vLLM output 0, completion 0, routed_experts: every expert id is 0 at all "
                      r"5 positions .*--enable-return-routed-experts"):  # fmt: skip
        routes_from_vllm([output], layers)
    output.outputs[0].routed_experts = zeros + np.eye(5, 1, dtype=np.uint8)[:, None]  # (one 1: a real payload may)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert routes_from_vllm([output], layers).mask.sum() == 5
