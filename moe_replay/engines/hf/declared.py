"""Which router classes take the Hugging Face engine's fast path, declared before any call, never learned from one.

Every router call takes the general path (its MoE block's forward and its own, under the interception of call.py),
which needs no fact about the model, unless its class is declared here: its top-k selection runs inside the router's
own forward (so the block is not intercepted), and, where the table gives a position, the router's output holds the
selected indices there (so a recording without replay reads them: no interception at all; about a quarter of a tiny
`generate`'s time, benchmarks/host_cost.py). A declaration applies only to the class itself, from its transformers
module, while the router's and its block's methods are their classes' own (none set on the instance, none replaced
on the class by code from another module): a subclass, a class swapped in place or a patched method takes the
general path.

Verified per transformers release (a class's output changes between releases: Aria's and Granite-MoE's indices are
at 0 in 5.19, at 2 in 5.25) by tests/engines/hf/test_families.py, which checks every declared class of every family
against the general path; under a release not verified here every router takes the general path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import FunctionType, MappingProxyType

from torch import nn

# classes that select inside the router and return no indices; those whose indices are at 0 in transformers 5.19
SELECT_ONLY = ("JetMoeTopKGating", "Llama4Router", "PhimoeTopKRouter", "ZayaRouter")
AT_0_IN_5_19 = (
    "AriaTextTopKRouter",
    "GraniteMoeTopKRouter",
    "GraniteMoeHybridTopKRouter",
    "GraniteMoeSharedTopKRouter",
)
ENV = "MOE_REPLAY_PATH"  # `general`: every router takes the general path (the declarations are not used)

# router class name -> where its output holds its top-k's indices (None: it selects inside itself, returns none)
AT_2 = """
    AXK1TopkRouter AXK2TopkRouter AfmoeTokenChoiceRouter AriaTextTopKRouter BailingHybridTopkRouter
    BeamTopKRouter Cohere2MoeTopKRouter DeepseekV2TopkRouter DeepseekV32TopkRouter DeepseekV3TopkRouter
    DeepseekV4TopKRouter Dots1TopkRouter Dots3NoteTextTopkRouter ErgoTopkRouter Ernie4_5_MoeTopKRouter
    ExaoneMoeTopkRouter FlexOlmoTopKRouter FlintTopKRouter Gemma4TextRouter Glm4MoeLiteTopkRouter
    Glm4MoeTopkRouter GlmMoeDsaTopkRouter GptOssTopKRouter GraniteMoeHybridTopKRouter GraniteMoeSWATopKRouter
    GraniteMoeSharedTopKRouter GraniteMoeTopKRouter HYV3TopKRouter HYV4TopkRouter HunYuanMoEV1Gate
    Inkling2LoopTopKRouter Inkling2TopKRouter InklingTopkRouter JambaTopKRouter KimiLinearTopkRouter
    Kolibri1TopKRouter Kolibri1_1TopKRouter LagunaTopKRouter LaraMiniTopKRouter Lfm2MoeTopKRouter
    LongcatFlashTopkRouter MellumTopKRouter MiMoV2FlashTopkRouter MiniCPM5MoeTopkRouter MiniMaxM2TopKRouter
    MiniMaxM3VLTopKRouter MiniMaxTopKRouter MixtralTopKRouter NemotronHTopkRouter OlmoeTopKRouter
    Qwen2MoeTopKRouter Qwen3MoeTopKRouter Qwen3NextTopKRouter Qwen3_5MoeTopKRouter Qwen4ExpTextTopKRouter
    SolarOpenTopkRouter
""".split()
FIVE_25: Mapping[str, int | None] = MappingProxyType({**dict.fromkeys(AT_2, 2), **dict.fromkeys(SELECT_ONLY, None)})
VERIFIED: Mapping[str, Mapping[str, int | None]] = MappingProxyType(
    {
        "5.25": FIVE_25,
        # 5.19: Aria's and three Granite-MoE routers return (indices, scores, logits)
        "5.19": MappingProxyType({**FIVE_25, **dict.fromkeys(AT_0_IN_5_19, 0)}),
    }
)
NOT_DECLARED = object()  # `declared`'s answer for a router that takes the general path
OWN_CODE = ("transformers.", "torch.")  # where a declared class's (and its bases') functions come from


def declarations(version: str | None = None) -> Mapping[str, int | None]:
    """The router classes declared for transformers `version` (default: the installed one), or none for a release
    not verified here, or under `MOE_REPLAY_PATH=general`.

    Example:
        >>> declarations("5.25.0")["Qwen3MoeTopKRouter"], len(declarations("4.57.0"))
        (2, 0)
    """
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "general"):
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not one of auto, general")
    if value == "general":
        return MappingProxyType({})
    if version is None:
        import transformers

        version = transformers.__version__
    return VERIFIED.get(".".join(version.split(".")[:2]), MappingProxyType({}))


def own_methods(module: nn.Module) -> bool:
    """Whether `module` runs its class's own transformers code: a class from a `transformers.models` module whose
    `forward` it defines itself, no function on it or its bases from outside transformers and torch, no method of the
    class replaced on the instance (a callable attribute that shadows none, an activation function, is data).

    Example:
        >>> own_methods(nn.Linear(2, 2))
        False
    """
    cls = type(module)
    home = cls.__module__
    forward = cls.__dict__.get("forward")
    if not home.startswith("transformers.models.") or not isinstance(forward, FunctionType):
        return False
    for klass in cls.__mro__:
        if klass is nn.Module:
            break
        for value in vars(klass).values():
            if isinstance(value, FunctionType) and not value.__module__.startswith(OWN_CODE):
                return False  # (a kernel library's or a user's function set on the class)
    return not any(callable(v) and not isinstance(v, nn.Module) and hasattr(cls, k) for k, v in module.__dict__.items())


def declared(router: nn.Module, block: nn.Module, table: Mapping[str, int | None]) -> int | None | object:
    """Where `router`'s output holds its top-k's indices by `table` (`declarations()`), None if it holds none, or
    `NOT_DECLARED`: its class is not declared, or it or its MoE `block` does not run its class's own code now.

    Example:
        >>> declared(model.model.layers[0].mlp.gate, model.model.layers[0].mlp, declarations())  # doctest: +SKIP
        2
    """
    name = type(router).__name__
    if name not in table or not own_methods(router) or not own_methods(block):
        return NOT_DECLARED
    return table[name]
