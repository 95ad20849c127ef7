"""Tiny MoE causal LMs built from a transformers config (random weights, offline, CPU): the one builder behind the
demo, the RL policy, the tests and the benchmarks.

Shapes: L layers (`layers`, some of them dense with `dense_layers`), E experts (`experts`), K experts per token
(`top_k`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

# Qwen3-MoE fields of the tiny default (about 0.4M parameters with E = 16); `tiny_moe` arguments override them.
TINY_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "pad_token_id": 0,
}
# The short argument names of `tiny_moe` and the Qwen3-MoE config fields they set.
SHORTHAND: dict[str, str] = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "experts": "num_experts",
    "top_k": "num_experts_per_tok",
    "vocab": "vocab_size",
    "dense_layers": "mlp_only_layers",
}
ROUTER_WEIGHT = "mlp.gate.weight"  # how Qwen3-MoE (and most transformers MoE families) name a router's weight


def tiny_moe(
    seed: int = 0,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    vocab: int | None = None,
    dense_layers: Sequence[int] | None = None,
    router_std: float | None = None,
    experts_implementation: str | None = None,
    **fields: Any,
) -> nn.Module:
    """A randomly initialised MoE causal LM from a transformers config, in eval mode, made under
    `torch.manual_seed(seed)` (which it leaves the global RNG advanced by).

    Qwen3-MoE by default (`TINY_QWEN3_MOE`); `layers`, `hidden`, `experts`, `top_k`, `vocab` and `dense_layers`
    (indices of MLP-only layers) are short names for its config fields, and `fields` sets any config field by its
    transformers name. `fields["model_type"]` picks another family, whose fields `fields` then gives in full (the
    short names are Qwen3-MoE's). `router_std` re-draws the router weights (`*.mlp.gate.weight`) from N(0, std²)
    so that top-k choices are not near ties. `experts_implementation` (e.g. "grouped_mm") is used where the family
    supports choosing one.

    Example:
        >>> model = tiny_moe(layers=3, experts=8, dense_layers=[1], router_std=0.5)  # doctest: +SKIP
        >>> model = tiny_moe(model_type="mixtral", num_local_experts=8, hidden_size=32)  # doctest: +SKIP
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    short = {"layers": layers, "hidden": hidden, "experts": experts, "top_k": top_k, "vocab": vocab}
    short["dense_layers"] = list(dense_layers) if dense_layers is not None else None
    short = {SHORTHAND[k]: v for k, v in short.items() if v is not None}
    both = sorted(set(short) & set(fields))
    if both:
        raise ValueError(f"{both} given twice: by a short argument and by its config field name")
    model_type = fields.pop("model_type", TINY_QWEN3_MOE["model_type"])
    if model_type == TINY_QWEN3_MOE["model_type"]:
        config = {**TINY_QWEN3_MOE, **short, **fields}
        config.pop("model_type")
    elif short:
        raise ValueError(f"short arguments set Qwen3-MoE fields {sorted(short)}; give {model_type!r} fields by name")
    else:
        config = fields
    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(model_type, **config)
    if experts_implementation is None:
        model = AutoModelForCausalLM.from_config(hf_config)
    else:
        try:
            model = AutoModelForCausalLM.from_config(hf_config, experts_implementation=experts_implementation)
        except (ValueError, TypeError):  # a family without selectable experts implementations
            model = AutoModelForCausalLM.from_config(hf_config)
    if router_std is not None:
        spread_routers(model, router_std)
    return model.eval()


def spread_routers(model: nn.Module, std: float) -> None:
    """Re-draw every router weight (`*.mlp.gate.weight`, in parameter order) from N(0, std²) with the global RNG.

    Example:
        >>> spread_routers(model, 0.5)  # doctest: +SKIP
    """
    with torch.no_grad():
        found = [p for name, p in model.named_parameters() if name.endswith(ROUTER_WEIGHT)]
        if not found:
            raise ValueError(f"{type(model).__name__} has no parameter named '*.{ROUTER_WEIGHT}' to re-draw")
        for p in found:
            p.normal_(0, std)


TINY_CHARS = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"  # ids 3.. (0 pad, 1 eos, 2 bos): 44 ids, under TINY vocab 64


def tiny_tokenizer() -> Any:
    """A character-level `PreTrainedTokenizerFast` built offline (pad 0, eos 1, bos 2, then `TINY_CHARS`), for
    the tiny models of `tiny_moe` (vocab 64) in trainers that need a tokenizer, such as TRL's.

    Example:
        >>> tok = tiny_tokenizer()
        >>> tok("1+2=").input_ids, tok.decode([4, 13, 5, 16])
        ([4, 13, 5, 16], '1+2=')
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(TINY_CHARS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
