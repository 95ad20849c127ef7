"""Engine payloads for the importer tests: a tiny model's recorded generation (3 decoder layers, layer 1 dense, 8
experts, top-2) encoded exactly as vLLM and SGLang encode their routes (docs/engines.md)."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import torch
from helpers import extend_mask, left_padded, tiny_qwen3_moe

from moe_replay import Routes, record_routes, replay_routes

DECODER_LAYERS, MOE_COLUMNS = 3, [0, 2]


def recorded_generation() -> SimpleNamespace:
    """A sampled, left-padded batch with its recorded routes, and each row's pad, prompt and completion tokens."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(4, 6, [0, 2, 3, 1])
    torch.manual_seed(0)
    with torch.no_grad(), record_routes(model) as rec:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=5,
            eos_token_id=7,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
    routes = rec.routes
    rows = []
    for i in range(ids.shape[0]):
        pad = int((mask[i] == 0).sum())
        span = routes.mask[i].nonzero().flatten()
        n = int(span.numel())
        prompt = ids[i, pad:].tolist()
        completion = out.sequences[i, 6 : 6 + n + 1 - len(prompt)].tolist()
        assert span.tolist() == list(range(pad, pad + n)) and n == len(prompt) + len(completion) - 1
        rows.append(
            SimpleNamespace(pad=pad, prompt=prompt, completion=completion, moe=routes.indices[i, pad : pad + n])
        )
    attention = extend_mask(mask, out.sequences.shape[1])  # (not `sequences != 0`: token 0 may be sampled)
    return SimpleNamespace(model=model, routes=routes, rows=rows, sequences=out.sequences, attention=attention)


def decoder_columns(moe: torch.Tensor, dtype) -> np.ndarray:  # noqa: ANN001
    """[n, 3 decoder layers, K]: the MoE layers' routes in their columns, the dense layer's column zero."""
    full = np.zeros((moe.shape[0], DECODER_LAYERS, moe.shape[2]), dtype=dtype)
    full[:, MOE_COLUMNS] = moe.numpy()
    return full


def vllm_outputs(gen, dtype=np.int32, split=False, server=False):  # noqa: ANN001, ANN201
    out = []
    for r in gen.rows:
        if split:  # vLLM 0.21: prompt routes separately, MoE-layer columns, int16
            prompt_routes, routes = r.moe[: len(r.prompt)].numpy().astype(np.int16), r.moe[len(r.prompt) :].numpy()
            routes = routes.astype(np.int16)
        else:
            prompt_routes, routes = None, decoder_columns(r.moe, dtype)
        if server:
            buf = io.BytesIO()
            np.save(buf, routes)
            choice = {"index": 0, "token_ids": r.completion, "routed_experts": base64.b64encode(buf.getvalue())}
            out.append({"prompt_token_ids": r.prompt, "choices": [choice]})
        else:
            choice = SimpleNamespace(index=0, token_ids=r.completion, routed_experts=routes)
            out.append(
                SimpleNamespace(prompt_token_ids=r.prompt, prompt_routed_experts=prompt_routes, outputs=[choice])
            )
    return out


def sglang_responses(gen):  # noqa: ANN001, ANN201
    return [
        {
            "text": "",
            "meta_info": {
                "prompt_tokens": len(r.prompt),
                "completion_tokens": len(r.completion),
                "routed_experts": base64.b64encode(decoder_columns(r.moe, np.int32).tobytes()).decode(),
            },
        }
        for r in gen.rows
    ]


def imported_equal(gen, routes: Routes) -> None:  # noqa: ANN001
    assert routes.equal(gen.routes), "imported routes differ from the recording"
    mask = gen.attention
    with torch.no_grad():
        with replay_routes(gen.model, routes):
            a = gen.model(gen.sequences, attention_mask=mask).logits
        with replay_routes(gen.model, gen.routes):
            b = gen.model(gen.sequences, attention_mask=mask).logits
    assert torch.equal(a, b)


def pads(gen):  # noqa: ANN001, ANN201
    return [r.pad for r in gen.rows]
