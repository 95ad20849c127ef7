"""Record / replay on every MoE causal-LM family of the installed transformers, each as a tiny model.

Families are discovered at collection time (a new family in a new transformers is tested automatically). For each:
(i) routes recorded under `generate` with left padding equal a teacher-forced forward's; (ii) replaying a model's own
routes gives identical logits; (iii) after perturbing all weights, replay uses exactly the recorded experts while live
routing changes some; (iv) routers get gradients under replay; (v) with gradient checkpointing the gradients equal the
plain run and nothing is recorded twice. fp32 for all; (i)-(ii) in bf16 for a representative subset.
"""

from __future__ import annotations

import pytest
import torch
from families import FamilyNotBuildable, build_tiny_model, discover_moe_families
from helpers import perturb, sampled
from transformers.utils import logging

from moe_replay import UnsupportedModelError, find_routers, record_routes, replay_routes
from moe_replay.engines.hf import UNSUPPORTED
from moe_replay.engines.hf.declared import declarations
from moe_replay.engines.hf.patch import MARKER

logging.set_verbosity_error()

FAMILIES = discover_moe_families()
BF16 = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "jamba", "llama4_text"]


def build(family: str, dtype: torch.dtype = torch.float32):
    try:
        model = build_tiny_model(family)
    except FamilyNotBuildable as e:
        pytest.skip(f"{family} cannot be built tiny on CPU: {e}")
    model = model.to(dtype)
    try:
        find_routers(model)
    except UnsupportedModelError as e:
        if any(cls in str(e) for cls in UNSUPPORTED):
            pytest.skip(f"{family} is unsupported by design: {e}")
        raise
    return model


def batch(model, B=3, T=8, pads=(2, 0, 4), seed=0):
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, min(vocab, 100), (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, p in enumerate(pads[:B]):
        mask[b, :p] = 0
        ids[b, :p] = pad_id(model)
    return ids, mask


def pad_id(model) -> int:
    p = model.config.get_text_config().pad_token_id
    return 0 if p is None else int(p)


def positions(mask):
    """position_ids as `generate` makes them from a left-padded attention mask."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def record(model, ids, mask, position_ids=None):
    with record_routes(model) as rec:
        logits = model(ids, attention_mask=mask, position_ids=position_ids).logits
    return rec.routes, logits


def router_param_names(model) -> dict[str, list[str]]:
    """Each router's trainable parameter names (qualified), by router name."""
    return {
        s.name: [f"{s.name}.{n}" for n, p in s.router.named_parameters() if p.requires_grad]
        for s in find_routers(model)
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_unsupported_families_raise_naming_the_class(family):
    try:
        model = build_tiny_model(family)
    except FamilyNotBuildable as e:
        pytest.skip(f"{family} cannot be built tiny on CPU: {e}")
    try:
        sites = find_routers(model)
    except UnsupportedModelError as e:
        assert any(cls in str(e) for cls in UNSUPPORTED), e
        with pytest.raises(UnsupportedModelError, match="|".join(UNSUPPORTED)):
            with record_routes(model):
                pass
        return
    assert len(sites) >= 2, f"{family}: expected at least 2 routers, found {[s.name for s in sites]}"


@pytest.mark.parametrize(
    "family, dtype",
    [pytest.param(f, torch.float32, id=f"{f}-fp32") for f in FAMILIES]
    + [pytest.param(f, torch.bfloat16, id=f"{f}-bf16") for f in BF16 if f in FAMILIES],
)
def test_generate_routes_match_teacher_forcing_and_replay_is_exact(path, family, dtype):
    model = build(family, dtype)
    ids, mask = batch(model)
    torch.manual_seed(0)
    out, gen = sampled(model, ids, mask, 4, output_logits=True, pad_token_id=pad_id(model))
    seq = out.sequences
    full = torch.cat([mask, mask.new_ones(mask.shape[0], seq.shape[1] - mask.shape[1])], 1)
    expected = full.bool().clone()
    expected[:, -1] = False
    assert gen.shape[:2] == tuple(seq.shape) and torch.equal(gen.mask, expected)
    tf, ref = record(model, seq, full, positions(full))
    # Where the model's own generate-time logits differ from its teacher-forced ones, the routes may differ too
    # (sparse-attention indexers and compressed attention treat left padding and partial blocks differently with a KV
    # cache): compare the routes where the model agrees with itself, prompt (prefill alone) and generated steps.
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    prefill = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
    first, steps = ids.shape[1] - 1, torch.stack(out.logits, 1)
    gen_logits = torch.cat([prefill[:, :first], steps], 1).float()
    agree = torch.isclose(gen_logits, ref[:, : gen_logits.shape[1]].float(), rtol=tol, atol=tol).all(-1)
    agree = torch.cat([agree, agree.new_ones(agree.shape[0], gen.seq_len - agree.shape[1])], 1)
    m = gen.mask & agree
    assert m.sum() >= 0.6 * gen.mask.sum(), f"generate and teacher forcing disagree at {int((~agree).sum())} positions"
    # (i) generate (KV cache, one position per step) and teacher forcing pick the same experts
    assert torch.equal(gen.indices[m].sort(-1).values, tf.indices[m].sort(-1).values)
    # (ii) replaying a model's own routes is bit-exact
    with replay_routes(model, tf):
        assert torch.equal(model(seq, attention_mask=full, position_ids=positions(full)).logits, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_forces_recorded_experts_after_update(family):
    model = build(family)
    ids, mask = batch(model)
    routes, _ = record(model, ids, mask)
    perturb(model, scale=0.5, seed=7, min_std=1e-2)
    live, live_logits = record(model, ids, mask)
    with replay_routes(model, routes), record_routes(model) as used:
        forced_logits = model(ids, attention_mask=mask).logits
    # (iii) under replay the experts used are the recorded ones; without it some tokens moved
    assert used.routes.equal(routes)
    assert not live.equal(routes), "perturbing every weight changed no expert choice: the check would be vacuous"
    assert not torch.equal(live_logits, forced_logits)
    # a declared router class (declared.py) replays exactly as the general path
    logits = {}
    for path in ("auto", "general"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MOE_REPLAY_PATH", path)
            with replay_routes(model, routes):
                logits[path] = model(ids, attention_mask=mask).logits
    assert torch.equal(logits["auto"], logits["general"]) and torch.equal(logits["general"], forced_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_declared_router_class_records_and_replays_as_the_general_path(family, monkeypatch):
    """Every router class declared for the installed transformers (declared.py) takes its declared path on the stock
    model, and what it records under `generate` (reading its output) and replays after an update (intercepting the
    router alone) equals the general path's, which intercepts the whole MoE block; an undeclared class takes the
    general path."""
    got = {}
    for path in ("auto", "general"):
        monkeypatch.setenv("MOE_REPLAY_PATH", path)
        model = build(family)  # (the same weights each time)
        ids, mask = batch(model)
        declared_here = type(find_routers(model)[0].router).__name__ in declarations()
        torch.manual_seed(0)
        with record_routes(model) as rec:
            flags = {r.declared for r in model.__dict__[MARKER].routers}
            out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, pad_token_id=pad_id(model))
        assert flags == {path == "auto" and declared_here}, flags
        perturb(model, scale=0.5, seed=7, min_std=1e-2)
        with replay_routes(model, rec.routes), record_routes(model) as used:
            logits = model(out, attention_mask=torch.ones_like(out)).logits
        got[path] = (out, rec.routes, used.routes, logits)
    (out_a, rec_a, used_a, logits_a), (out_g, rec_g, used_g, logits_g) = got["auto"], got["general"]
    assert torch.equal(out_a, out_g) and rec_a.equal(rec_g)
    assert torch.equal(logits_a, logits_g) and used_a.equal(used_g)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_gradients_and_checkpointing(path, family):
    model = build(family)
    ids, mask = batch(model)
    routes, _ = record(model, ids, mask)
    perturb(model, scale=0.5, seed=7, min_std=1e-2)
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        with replay_routes(model, routes), record_routes(model) as rec:
            model(ids, attention_mask=mask, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, rec

    plain, _ = step()
    # (iv) every router gets a non-zero gradient under replay
    for router, names in router_param_names(model).items():
        assert any(n in plain and plain[n].abs().sum() > 0 for n in names), f"no gradient reached router {router}"
    if not model.supports_gradient_checkpointing:
        pytest.skip(f"{family} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt, rec = step()
    # (v) the recompute replays the same routes (same gradients) and is not recorded a second time
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-4, atol=1e-6, msg=n)
    assert len(rec.batches) == 1 and rec.routes.equal(routes)
