"""Check a live vLLM or SGLang engine's routes against the trainer model, end to end (needs a GPU and the engine).

Samples a few completions with routes returned, imports them with moe-replay, and prints how many routed experts
differ from a teacher-forced forward of the same tokens in the trainer model (Hugging Face transformers, bf16):
a few percent is the expected engine/trainer mismatch; tens of percent means misaligned routes.

    python scripts/check_engine_routes.py vllm Qwen/Qwen3-30B-A3B
    python scripts/check_engine_routes.py sglang Qwen/Qwen3-30B-A3B
    python scripts/check_engine_routes.py vllm Qwen/Qwen3-30B-A3B --start 4   # routes from prompt position 4 on
"""

from __future__ import annotations

import argparse

import torch


def sample_vllm(
    name: str, prompts: list[list[int]], new: int, start: int
) -> tuple[list[list[int]], list[list[int]], object]:
    from vllm import LLM, SamplingParams

    llm = LLM(name, enable_return_routed_experts=True)
    extra = {"routed_experts_prompt_start": start} if start else {}  # (vLLM >= 0.33)
    params = SamplingParams(max_tokens=new, temperature=1.0, **extra)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.prompt_token_ids for o in outputs], [o.outputs[0].token_ids for o in outputs], outputs


def sample_sglang(
    name: str, prompts: list[list[int]], new: int, start: int
) -> tuple[list[list[int]], list[list[int]], object]:
    import sglang

    engine = sglang.Engine(model_path=name, enable_return_routed_experts=True)
    params = {"max_new_tokens": new, "temperature": 1.0}
    extra = {"routed_experts_start_len": start} if start else {}
    responses = engine.generate(input_ids=prompts, sampling_params=params, return_routed_experts=True, **extra)
    return prompts, [r["output_ids"] for r in responses], responses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=["vllm", "sglang"])
    ap.add_argument("model")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument(
        "--start",
        type=int,
        default=0,
        help="ask for routes from this prompt position on (vLLM >= 0.33 "
        "routed_experts_prompt_start, SGLang routed_experts_start_len); the positions before it are not compared",
    )
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moe_replay import expert_change, teacher_forced_routes

    tok = AutoTokenizer.from_pretrained(args.model)
    texts = ["The capital of France is", "def fibonacci(n):", "In 1905, Einstein", "Routing replay means"]
    prompts = [tok(t).input_ids for t in texts]
    sample = sample_vllm if args.engine == "vllm" else sample_sglang
    prompt_ids, completion_ids, raw = sample(args.model, prompts, args.new, args.start)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, device_map="cuda")
    P = max(len(p) for p in prompt_ids)
    pad = [P - len(p) for p in prompt_ids]
    T = max(P + len(c) for c in completion_ids)
    seqs = torch.full((len(prompts), T), tok.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(seqs)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        row = list(p) + list(c)
        seqs[i, pad[i] : pad[i] + len(row)] = torch.tensor(row)
        mask[i, pad[i] : pad[i] + len(row)] = 1
    if args.engine == "vllm":
        from moe_replay.integrations.vllm import routes_from_vllm

        routes = routes_from_vllm(raw, model, pad_left=pad, seq_len=T, prompt_start=args.start)
    else:
        from moe_replay.integrations.sglang import routes_from_sglang

        routes = routes_from_sglang(raw, model, pad_left=pad, seq_len=T, start_len=args.start)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    live = teacher_forced_routes(model, seqs.cuda(), mask.cuda(), position_ids=position_ids.cuda())
    change = expert_change(routes.to("cuda"), live, label=f"{args.engine} vs transformers")
    print(
        f"{routes}\nrouted experts that differ, {change.label}: {change.fraction:.2%} of choices, "
        f"{change.token_changed:.1%} of tokens in at least one layer"
    )


if __name__ == "__main__":
    main()
