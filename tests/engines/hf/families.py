"""Tiny, fast, CPU-buildable models for every Mixture-of-Experts causal-LM family in the installed transformers.

* ``discover_moe_families()`` finds the families at call time (a new family in a new transformers is picked up).
* ``tiny_config()`` shrinks a family's default config: a generic override step (whichever common attribute names the
  config has), then a small per-family table (``_FAMILY``), each entry commented with why it is needed.
* ``build_tiny_model()`` builds the model in fp32 / eval mode with non-degenerate router weights.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "FAMILY_NOTES",
    "FamilyNotBuildable",
    "build_tiny_model",
    "discover_moe_families",
    "router_modules",
    "router_recorder",
    "tiny_config",
]


class FamilyNotBuildable(Exception):
    """Raised when a family truly cannot be built tiny on CPU; the message is a one-line reason."""


# --------------------------------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------------------------------


def _causal_lm_module(model_type: str) -> ModuleType | None:
    """The modeling module defining the family's causal-LM class (None if it cannot be imported).

    Resolved through the class rather than the model type, so aliases such as ``sarvam_mla`` (whose causal LM is
    ``DeepseekV3ForCausalLM``) and model types whose folder differs from their name are handled.
    """
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None:
        return None
    try:
        return importlib.import_module(getattr(transformers, class_name).__module__)
    except Exception:  # noqa: BLE001 - missing optional deps or a broken module just mean "not a candidate"
        return None


def router_recorder(model_type: str) -> Any | None:
    """The ``OutputRecorder`` the family's modeling module registers under ``"router_logits"``, or None."""
    module = _causal_lm_module(model_type)
    if module is None:
        return None
    for obj in vars(module).values():
        if (
            inspect.isclass(obj)
            and issubclass(obj, PreTrainedModel)
            and obj.__module__ == module.__name__
            and "router_logits" in (getattr(obj, "_can_record_outputs", None) or {})
        ):
            recorder = obj._can_record_outputs["router_logits"]
            if getattr(recorder, "target_class", None) is not None:
                return recorder
    return None


def discover_moe_families() -> list[str]:
    """Sorted causal-LM model types whose modeling module records ``router_logits`` through an ``OutputRecorder``."""
    return sorted(mt for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if router_recorder(mt) is not None)


def router_modules(model: torch.nn.Module, model_type: str) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module the family's router ``OutputRecorder`` would record, in model order."""
    recorder = router_recorder(model_type)
    if recorder is None:
        return []
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, recorder.target_class)
        and (recorder.layer_name is None or name.endswith(recorder.layer_name))
    ]


# --------------------------------------------------------------------------------------------------------------------
# Tiny configs: generic step
# --------------------------------------------------------------------------------------------------------------------

HIDDEN = 32
VOCAB = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
LAYERS = 3  # [dense, moe, moe] where the family supports dense layers, else [moe, moe, moe]

# attribute -> tiny value, applied to whichever of these the family's config actually has
_GENERIC: dict[str, Any] = {
    # widths
    "hidden_size": HIDDEN,
    "d_model": HIDDEN,
    "intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "ffn_hidden_size": 64,
    "dense_intermediate_size": 64,
    "prefix_dense_intermediate_size": 64,
    "moe_intermediate_size": 16,
    "expert_ffn_hidden_size": 16,
    "shared_expert_intermediate_size": 16,
    "shared_experts_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16,
    "router_hidden_size": 16,
    "hc_lowrank": 8,
    "loop_gate_rank": 8,
    # attention
    "num_attention_heads": HEADS,
    "n_heads": HEADS,
    "swa_num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "swa_num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "swa_head_dim": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    # multi-head latent attention (see _mla for the head-count / head_dim coupling)
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "qk_head_dim": 8,
    "v_head_dim": 8,
    # sparse-attention indexers
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 4,
    # linear attention / gated delta net
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    # mamba (expand * hidden == n_heads * head_dim)
    "mamba_d_state": 8,
    "mamba_dt_rank": 4,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_chunk_size": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 8,
    "mamba_n_groups": 1,
    "n_groups": 1,
    # vocab / depth
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "num_hidden_layers": LAYERS,
    "n_layers": LAYERS,
    "num_layers": LAYERS,
    "max_position_embeddings": 512,
    # one leading dense layer where the family interleaves dense and MoE layers
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "moe_layer_start_index": 1,
    "mlp_only_layers": [0],
}

_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_NAMES = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "top_k",
    "moe_top_k",
    "moe_topk",
    "moe_k",
    "top_k_experts",
)
_SHARED_EXPERT_NAMES = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_GROUP_NAMES = ("n_group", "num_expert_group")
_SLIDING_NAMES = ("sliding_window", "sliding_window_size")
_SPECIAL_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "eod_token_id": 3, "sep_token_id": 4}


def _groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """``(n_group, topk_group)``: groups of >= 2 experts dividing ``num_experts``, kept groups holding >= top_k."""
    for n_group in (4, 2):
        if num_experts % n_group == 0 and num_experts // n_group >= 2:
            topk_group = n_group // 2
            if topk_group * (num_experts // n_group) >= top_k:
                return n_group, topk_group
    return 1, 1


def _generic_kwargs(default: PretrainedConfig, num_experts: int, top_k: int) -> dict[str, Any]:
    """Tiny values for every generic attribute that ``default`` has."""
    present = default.to_dict()
    kw: dict[str, Any] = {k: v for k, v in _GENERIC.items() if k in present}
    kw.update({name: num_experts for name in _EXPERT_COUNT_NAMES if name in present})
    kw.update({name: top_k for name in _TOP_K_NAMES if name in present})
    kw.update({name: 1 for name in _SHARED_EXPERT_NAMES if present.get(name)})
    n_group, topk_group = _groups(num_experts, top_k)
    kw.update({name: n_group for name in _GROUP_NAMES if name in present})
    if "topk_group" in present:
        kw["topk_group"] = topk_group
    kw.update({name: 8 for name in _SLIDING_NAMES if present.get(name)})
    kw.update({name: value for name, value in _SPECIAL_TOKEN_IDS.items() if name in present})
    kw["dtype"] = torch.float32
    return kw


def _layer_kwargs(default: PretrainedConfig, kw: dict[str, Any]) -> dict[str, Any]:
    """Per-layer settings that depend on the final layer count, unless the family table already set them."""
    present = default.to_dict()
    layers = kw.get("num_hidden_layers", kw.get("n_layers", kw.get("num_layers", LAYERS)))
    extra: dict[str, Any] = {}
    if "sparse" in (present.get("mlp_layer_types") or []) and "mlp_layer_types" not in kw:
        extra["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    if "moe_layer_end_index" in present:
        extra["moe_layer_end_index"] = layers - 1
    return extra


# --------------------------------------------------------------------------------------------------------------------
# Tiny configs: per-family adjustments
# --------------------------------------------------------------------------------------------------------------------

Adjust = Callable[[int, int], dict[str, Any]]


def _mla(num_experts: int, top_k: int) -> dict[str, Any]:
    """Multi-head latent attention: kv heads == heads, and ``head_dim`` is the rotary part of q/k."""
    return {"num_key_value_heads": HEADS, "head_dim": 4}


def _next_square(n: int) -> int:
    """Smallest perfect square >= n."""
    root = 1
    while root * root < n:
        root += 1
    return root * root


# model_type -> (num_experts, top_k) -> config kwargs applied after the generic step. For composite (multimodal)
# configs, the text model type's entry shrinks ``text_config`` and the top-level entry is passed to the outer config.
_FAMILY: dict[str, Adjust] = {
    "axk1": _mla,
    "axk2": _mla,
    # hybrid: full attention every `layer_group_size` layers; the cache needs at least one full-attention layer
    "bailing_hybrid": lambda n, k: {"num_hidden_layers": 4, "layer_group_size": 2, **_mla(n, k)},
    # default keeps the first 3 layers dense
    "beam": lambda n, k: {"mlp_layer_types": ["dense", "sparse", "sparse"]},
    # `first_k_dense_replace` is a kwarg popped by __post_init__ (not an attribute); sliding + full over 3 layers
    "cohere2_moe": lambda n, k: {"first_k_dense_replace": 1, "sliding_window_pattern": 2},
    # attention / FFN sizes live in sub-configs; DbrxAttention reads `attn_config.rope_theta` (not a field of the
    # attention sub-config) and calls clamp(min=None, max=None) unless `clip_qkv` is set, which current torch rejects
    "dbrx": lambda n, k: {
        "attn_config": {"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": n, "moe_top_k": k},
    },
    # exercise the group-limited path (default is plain greedy). Its group score is the group's max, so with
    # topk_group >= top_k it always equals plain greedy; keep one of two groups so the group limit changes choices
    "deepseek_v2": lambda n, k: {
        "topk_method": "group_limited_greedy",
        **({"n_group": 2, "topk_group": 1} if n % 2 == 0 and n // 2 >= k else {}),
        **_mla(n, k),
    },
    "deepseek_v3": _mla,
    "deepseek_v32": _mla,
    # layer 0 uses hash routing (frozen token-id -> expert table; not a recorded router), layers 1-2 top-k routing;
    # compress rates shrunk so compressed attention sees some compressed tokens at these sequence lengths
    "deepseek_v4": lambda n, k: {
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    },
    # MoE is opt-in; product-key routing only reaches floor(sqrt(num_experts))**2 experts, so use a square count
    "doge": lambda n, k: {"is_moe": True, "num_experts": _next_square(n)},
    # shared-expert count defaults to None, which the model cannot build
    "dots1": lambda n, k: {"n_shared_experts": 1},
    # the outer config validates the vision / audio adapters' output width against the text hidden size
    "dots3_note": lambda n, k: {
        "vision_config": {"adapter_out_dim": HIDDEN},
        "audio_config": {"adapter_out_dim": HIDDEN},
    },
    # sliding-window layers take their own MLA sizes from `swa_*` kwargs that __post_init__ pops
    "dots3_note_text": lambda n, k: {
        **_mla(n, k),
        "swa_num_attention_heads": HEADS,
        "swa_num_key_value_heads": HEADS,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 8,
        "swa_qk_nope_head_dim": 4,
        "swa_v_head_dim": 8,
    },
    # default keeps layers 0 and 1 dense
    "flint": lambda n, k: {"mlp_only_layers": [0]},
    # the MoE block is opt-in (it runs beside the dense MLP in every layer); the full-attention layers' head dim is a
    # popped kwarg (default 512) and per-layer input embeddings are shrunk
    "gemma4_text": lambda n, k: {
        "enable_moe_block": True,
        "hidden_size_per_layer_input": 8,
        "global_head_dim": HEAD_DIM,
    },
    "glm4_moe_lite": _mla,
    "glm_moe_dsa": _mla,
    # default is all-mamba; the cache needs one attention layer
    "granitemoehybrid": lambda n, k: {"layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    "hy_v4": _mla,
    # loop layer 1 twice (its router runs twice per forward); loop bounds must be multiples of the residual block size
    "inkling2_loop_text": lambda n, k: {
        "n_layers_per_attn_res_block": 1,
        "loop_layer_index_start": 1,
        "loop_layer_index_end": 2,
        "loop_num_passes": 2,
    },
    # experts on layers 1 and 3, attention on layer 2, mamba elsewhere (defaults put attention at layer 4 of 8)
    "jamba": lambda n, k: {
        "num_hidden_layers": 4,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
    },
    # KDA linear attention + full (MLA) attention; the cache needs a full-attention layer
    "kimi_linear": lambda n, k: {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        **_mla(n, k),
    },
    # NVFP4 key/value rounding needs head_dim % 16 == 0; layer 1 is an indexed (sparse) attention layer, kept small so
    # that the indexer selects from a pool; the default keeps layers 0 and 1 dense
    "kolibri1_1": lambda n, k: {
        "head_dim": 16,
        "layer_types": ["sliding_attention", "indexed_attention", "sliding_attention"],
        "mlp_only_layers": [0],
        "index_num_heads": 2,
        "index_topk": 4,
        "index_pool_size": 8,
        "index_compression": 2,
        "index_num_local_tokens": 2,
        "index_num_sink_tokens": 1,
        "sliding_window": 8,
    },
    # layer_types defaults to None, which the model cannot build; conv / attention / conv
    "lfm2_moe": lambda n, k: {"layer_types": ["conv", "full_attention", "conv"]},
    # layer 0 dense; small attention chunk so chunked attention is exercised
    "llama4_text": lambda n, k: {"moe_layers": [1, 2], "attention_chunk_size": 8},
    # each "layer" holds two attention sub-blocks and one MoE; keep a few zero (identity) experts
    "longcat_flash": lambda n, k: {"num_layers": 2, "zero_expert_num": 2, **_mla(n, k)},
    # one block type per layer (mamba / moe / attention / mlp); no room for a dense "mlp" layer within 4 layers
    "nemotron_h": lambda n, k: {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
        "chunk_size": 8,
    },
    # gated-delta-net hybrids: full attention every 4th layer; the cache needs one
    "qwen3_5_moe_text": lambda n, k: {"num_hidden_layers": 4},
    "qwen3_next": lambda n, k: {"num_hidden_layers": 4},
    # ... and the indexed (QSA) attention layer needs indexer sizes, which default to None
    "qwen4_exp_text": lambda n, k: {
        "num_hidden_layers": 4,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    "sarvam_mla": _mla,
    # ZAYA validates num_experts_per_tok == 1
    "zaya": lambda n, k: {"num_experts_per_tok": 1},
}

# (num_experts, top_k) combinations a family's modeling code cannot run -> reason (None when fine)
_CONSTRAINTS: dict[str, Callable[[int, int], str | None]] = {
    "longcat_flash": lambda n, k: "LongcatFlashExperts squeezes the top-k dim, so top_k=1 crashes" if k == 1 else None,
}

FAMILY_NOTES: dict[str, str] = {
    "afmoe": "router(hidden_states, expert_bias): the correction bias lives on the MoE block and is passed in.",
    "dbrx": "router returns only logits; top-k/softmax happen in DbrxFFN. Needs attn_config.rope_theta + clip_qkv.",
    "deepseek_v2": "topk_method='group_limited_greedy' with n_group=2, topk_group=1 (with topk_group >= top_k the "
    "max-based group limit is a no-op).",
    "deepseek_v4": "layer 0 is a hash_moe layer: DeepseekV4HashRouter (tid2eid[input_ids]) is NOT the recorded "
    "router class; tid2eid re-initialised to random distinct experts per token.",
    "doge": "recorded module is the whole DogeCDMoE (output index 1); router_logits are product-key logits of shape "
    "(2, tokens, sqrt(E)), and the view() mixes tokens so full-forward routing is not causal. num_experts rounded up "
    "to a perfect square.",
    "gemma4": "MoE block opt-in (enable_moe_block); router output[0] is softmax probabilities, not logits; the router "
    "sees the pre-MLP residual and runs beside the dense MLP.",
    "gemma4_text": "see gemma4.",
    "hy_v3": "router(hidden_states, e_score_correction_bias): bias owned by the MoE block.",
    "inkling2_loop_text": "layer 1 is looped twice, so its router module runs twice per forward.",
    "inkling_text": "router weight has E+1 rows (shared-expert sink); router returns 4 outputs.",
    "jetmoe": "two routers per layer (mixture-of-attention heads + MoE MLP); supports_gradient_checkpointing=False; "
    "router returns (sorted expert idx, batch idx, gates, expert sizes, logits), logits at index 4.",
    "lfm2_moe": "router(hidden_states, expert_bias): bias owned by the MoE block.",
    "llama4": "router returns (sigmoid top-k scores scattered to [T, E], logits); no indices; recorded index is 1.",
    "llama4_text": "see llama4.",
    "longcat_flash": "router logits have n_routed + zero_expert_num columns; zero experts are identity experts; "
    "top_k=1 raises FamilyNotBuildable.",
    "minimax_m2": "router(hidden_states, e_score_correction_bias): bias owned by the MoE block.",
    "nemotron_h": "4 single-block layers (mamba, moe, attention, moe); no dense layer.",
    "zaya": "top_k forced to 1; router is an MLP fed the previous layer's router state; logits have E+1 columns "
    "(skip expert, whose index is rewritten to 0 with weight 0); balancing_biases left at their defaults.",
}


def _family(model_type: str, num_experts: int, top_k: int) -> dict[str, Any]:
    adjust = _FAMILY.get(model_type)
    return adjust(num_experts, top_k) if adjust is not None else {}


def _tiny_kwargs(default: PretrainedConfig, num_experts: int, top_k: int) -> dict[str, Any]:
    kw = _generic_kwargs(default, num_experts, top_k)
    kw.update(_family(default.model_type, num_experts, top_k))
    kw.update(_layer_kwargs(default, kw))
    return kw


def tiny_config(model_type: str, *, num_experts: int = 8, top_k: int = 2) -> PretrainedConfig:
    """A tiny fp32 config of ``model_type`` with ``num_experts`` routed experts and ``top_k`` experts per token."""
    if router_recorder(model_type) is None:
        raise FamilyNotBuildable(f"{model_type!r} is not a discovered MoE causal-LM family")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    constraint = _CONSTRAINTS.get(model_type)
    if constraint is not None and (reason := constraint(num_experts, top_k)):
        raise FamilyNotBuildable(reason)
    default = AutoConfig.for_model(model_type)
    text_cls = (getattr(default, "sub_configs", None) or {}).get("text_config")
    if text_cls is not None:
        # composite (multimodal) config: the causal LM is built from the tiny text_config
        text_config = text_cls(**_tiny_kwargs(text_cls(), num_experts, top_k))
        config = type(default)(text_config=text_config, **_family(model_type, num_experts, top_k))
    else:
        config = type(default)(**_tiny_kwargs(default, num_experts, top_k))
    config.dtype = torch.float32
    return config


# --------------------------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------------------------

ROUTER_WEIGHT_STD = 0.5
ROUTER_BIAS_STD = 0.1
# recorded module is bigger than the router: only these of its parameters are router weights
_ROUTER_PARAMS: dict[str, tuple[str, ...]] = {"doge": ("router_gate.weight",)}


def _is_router_bias(name: str) -> bool:
    """A router bias or expert-score correction bias (re-initialised small); not e.g. ZAYA's skip-expert biases."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "bias" or "correction_bias" in leaf or leaf == "expert_bias"


@torch.no_grad()
def _reinit_routers(model: torch.nn.Module, model_type: str) -> None:
    """Router weights ~ N(0, 0.5) (well-separated top-k) and expert-score correction biases ~ N(0, 0.1)."""
    modules = dict(model.named_modules())
    only = _ROUTER_PARAMS.get(model_type)
    for name, router in router_modules(model, model_type):
        tensors = [*router.named_parameters(), *router.named_buffers()]
        # correction biases some families keep on the MoE block and pass into the router
        parent = modules.get(name.rpartition(".")[0])
        if parent is not None:
            tensors += [
                (n, t)
                for n, t in [*parent.named_parameters(recurse=False), *parent.named_buffers(recurse=False)]
                if "correction_bias" in n or n == "expert_bias"
            ]
        for pname, tensor in tensors:
            if not tensor.is_floating_point() or (only is not None and pname not in only):
                continue
            if _is_router_bias(pname):
                tensor.normal_(0.0, ROUTER_BIAS_STD)
            elif tensor.dim() >= 2 and pname.rsplit(".", 1)[-1] == "weight":
                tensor.normal_(0.0, ROUTER_WEIGHT_STD)


@torch.no_grad()
def _reinit_hash_routing(model: torch.nn.Module) -> None:
    """Hash-routing tables (token id -> top_k experts) default to all zeros; use random distinct experts."""
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor) and hasattr(module, "num_experts"):
            rows = [torch.randperm(module.num_experts)[: table.shape[1]] for _ in range(table.shape[0])]
            table.copy_(torch.stack(rows))


def build_tiny_model(model_type: str, *, seed: int = 0, **kw: Any) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_config(tiny_config(...))`` under ``torch.manual_seed(seed)``, fp32, eval mode."""
    config = tiny_config(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinit_routers(model, model_type)
    _reinit_hash_routing(model)
    return model.float().eval()
