"""The Hugging Face transformers model families whose packed forward (sequences concatenated in one row, position_ids
restarting per sequence, no attention mask, no cache) runs every sequence on its own, so that `replay_routes` of
`to_packed(...)` gives the padded batch's log-probs. Elsewhere state flows along the row (state-space, linear or
compressed attention, short convolutions), or the masks ignore the restarting position_ids (gpt_oss, afmoe), or a
sparse-attention indexer's top-k breaks its ties differently on a row of another length (deepseek_v32, glm_moe_dsa,
axk2, dots3_note, hy_v4): the packed log-probs then differ silently, and packed routes are refused.

Verified by tests/engines/hf/test_packed_families.py on each discovered MoE family's tiny fp32 model (weights
perturbed, routes replayed both ways), per transformers release (a family's code changes between releases: llama4's
packed forward mixes sequences in 5.19, not in 5.25): a family is listed only when its packed per-token log-probs equal
the padded forward's within 1e-4 (5.25, on the test's batch: listed families at most 1.4e-6, the others from 5.7e-3;
listed families at most 2.4e-5 over 19 batches and perturbations). Every other family, and every family under a
transformers release not verified here, is refused.
"""

from __future__ import annotations

# `model.config.model_type` of the top-level causal LM (a multimodal family's causal LM may carry its text model's type:
# llama4 -> llama4_text, as AutoModelForCausalLM builds it), by the transformers release (major.minor) verified
FIVE_25: frozenset[str] = frozenset(
    """
    aria_text axk1 beam cohere2_moe dbrx deepseek_v2 deepseek_v3 dots1 ergo ernie4_5_moe exaone_moe flex_olmo
    flint gemma4 gemma4_text glm4_moe glm4_moe_lite granitemoe granitemoe_swa granitemoeshared hunyuan_v1_moe
    hy_v3 jetmoe kolibri1 kolibri1_1 laguna llama4_text longcat_flash mellum mimo_v2_flash minicpm5_moe
    minimax_m2 minimax_m3_vl_text mixtral olmoe param2moe phimoe qwen2_moe qwen3_moe sarvam_mla sarvam_moe
    solar_open
    """.split()
)
VERIFIED: dict[str, frozenset[str]] = {
    "5.25": FIVE_25,
    # 5.19: those of 5.25 that it has, but llama4_text (its packed forward mixes sequences there)
    "5.19": FIVE_25
    - frozenset(
        """
        beam ergo flint jetmoe kolibri1 kolibri1_1 minicpm5_moe param2moe sarvam_mla sarvam_moe llama4_text
        """.split()
    ),  # fmt: skip
}


def packed_families(version: str | None = None) -> frozenset[str]:
    """The model types whose packed forward with replayed routes equals the padded forward's under transformers
    `version` (default: the installed one), or none for a release not verified here.

    Example:
        >>> "qwen3_moe" in packed_families("5.25.0"), packed_families("4.57.0")
        (True, frozenset())
    """
    if version is None:
        import transformers

        version = transformers.__version__
    release = ".".join(version.split(".")[:2])
    return VERIFIED.get(release, frozenset())
