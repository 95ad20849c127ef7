"""CPU shims and a tiny GPTModel for the megatron-core tests (test shims only: the library never patches Megatron).

megatron-core expects CUDA; on CPU with gloo it runs given: `torch.cuda.current_device` answering the CPU device,
a CPU stand-in for the model-parallel CUDA RNG tracker (and no CUDA RNG state for activation recompute to save), no
Transformer Engine GEMM for the router (0.16.x), an explicit attention mask, no linear biases and CPU initialisation.
The alltoall token dispatcher also gets a CPU stand-in for its device-to-host CUDA stream, and its split sizes (CPU
tensors, where on a GPU they are NumPy arrays) handed to gloo's `all_to_all_single` as lists.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import torch

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K = 32, 64, 2, 4, 2


class CpuRngTracker:
    """Stands in for megatron's CudaRNGStatesTracker: `fork` runs the block on a forked CPU RNG."""

    def __init__(self) -> None:
        self.states_: dict[str, Any] = {}

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, Any]:
        return dict(self.states_)

    def set_states(self, states: dict[str, Any]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self.states_[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        with torch.random.fork_rng(devices=[]):
            yield


class CpuStream:
    """Stands in for the alltoall dispatcher's CUDA side stream and its events: CPU work already runs in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> CpuStream:
        return self

    def synchronize(self) -> None:
        pass


def split_sizes_as_lists(all_to_all_single: Any) -> Any:
    """`all_to_all_single` taking split sizes given as a tensor (as the alltoall dispatcher keeps them on the CPU)."""

    def call(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        def listed(sizes: Any) -> Any:
            return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes

        return all_to_all_single(output, input, listed(output_split_sizes), listed(input_split_sizes), *args, **kwargs)

    return call


class CpuTorch:
    """megatron's schedules module's view of torch: `zeros(..., device="cuda")` (a token counter) lands on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def megatron_cpu(
    tp: int = 1,
    ep: int = 1,
    rank: int = 0,
    world: int = 1,
    port: int = 29531,
    pp: int = 1,
    vpp: int | None = None,
    etp: int | None = None,
    cp: int = 1,
) -> Iterator[None]:
    """Apply the CPU shims, start a gloo process group and megatron's parallel state (`etp`: expert tensor parallel
    size, default `tp`); undo all of it on exit. Pipeline models also need `batch_p2p_comm=False` in their config (the
    batched p2p path syncs CUDA)."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message=".*Apex.*")
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as tpr
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as AllToAll

    saved = (torch.cuda.current_device, tpr._CUDA_RNG_STATE_TRACKER, tpr._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    saved_rng = (tpr._get_cuda_rng_state, tpr._set_cuda_rng_state)
    tpr._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0)  # recompute saves the CPU RNG state itself
    tpr._set_cuda_rng_state = lambda *args, **kwargs: None
    had_gemm, saved_gemm = hasattr(moe_utils, "te_general_gemm"), getattr(moe_utils, "te_general_gemm", None)
    torch.cuda.current_device = lambda: torch.device("cpu")
    tpr._CUDA_RNG_STATE_TRACKER, tpr._CUDA_RNG_STATE_TRACKER_INITIALIZED = CpuRngTracker(), True
    moe_utils.te_general_gemm = None  # 0.16.x reads this name even when Transformer Engine is absent
    schedules.torch = CpuTorch()
    cuda, dist = torch.cuda, torch.distributed
    saved_streams = (cuda.Stream, cuda.current_stream, cuda.stream, dist.all_to_all_single, AllToAll.cuda_dtoh_stream)
    stream = CpuStream()
    cuda.Stream, cuda.current_stream = CpuStream, lambda *args, **kwargs: stream  # (a class: code annotates with it)
    cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    dist.all_to_all_single, AllToAll.cuda_dtoh_stream = split_sizes_as_lists(dist.all_to_all_single), None
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_tensor_parallel_size=etp,
            context_parallel_size=cp,
        )
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        schedules.torch = torch
        cuda.Stream, cuda.current_stream, cuda.stream, dist.all_to_all_single, AllToAll.cuda_dtoh_stream = saved_streams
        torch.cuda.current_device, tpr._CUDA_RNG_STATE_TRACKER, tpr._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved
        tpr._get_cuda_rng_state, tpr._set_cuda_rng_state = saved_rng
        if had_gemm:
            moe_utils.te_general_gemm = saved_gemm
        else:
            del moe_utils.te_general_gemm


class TokenLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm under megatron's norm signature; it normalises each token, so a sequence-parallel slice
    needs nothing else (its weight gradients are partial per rank, which these tests do not compare)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)


def tiny_gpt(
    seed: int = 0, model_kwargs: dict[str, Any] | None = None, attention: bool = True, **overrides: Any
) -> torch.nn.Module:
    """A 2-layer GPTModel, hidden 64, 4 experts, top-2, routing replay on, weights set from `seed` by parameter
    name so that models split over ranks hold the same weights as one unsplit model. `overrides` go to the
    TransformerConfig, `model_kwargs` to GPTModel (a pipeline stage's `pre_process`, `post_process`, `vp_stage`).
    `attention=False` leaves attention out of every layer and embeds positions (learned, absolute): a GPT whose tokens
    do not interact, which runs under context parallelism and with packed sequences without Transformer Engine."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    fields = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "num_attention_heads": 4,
        "ffn_hidden_size": 128,
        "num_moe_experts": EXPERTS,
        "moe_router_topk": TOP_K,
        "moe_ffn_hidden_size": 64,
        "moe_token_dispatcher_type": "allgather",
        "moe_enable_routing_replay": True,
        "add_bias_linear": False,
        "use_cpu_initialization": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "params_dtype": torch.float32,
    }
    fields.update(overrides)
    config = TransformerConfig(**fields)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if not attention:
        from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

        spec.submodules.input_layernorm = spec.submodules.self_attention = IdentityOp
        spec.submodules.self_attn_bda = IdentityFuncOp
        model_kwargs = {"position_embedding_type": "learned_absolute", **(model_kwargs or {})}
    if "moe_layer_freq" in overrides or config.pipeline_model_parallel_size > 1:  # this stage's layers, per pattern
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        vp_stage = (model_kwargs or {}).get("vp_stage")
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    elif config.sequence_parallel:  # megatron's torch-norm wrapper refuses sequence parallelism (it wants TE or apex)
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        spec.submodules.pre_mlp_layernorm = TokenLayerNorm
        if attention:
            spec.submodules.input_layernorm = TokenLayerNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=TokenLayerNorm)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64, **(model_kwargs or {})
    )
    set_weights(model, seed)
    return model


def set_weights(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter values drawn from (seed, its unsplit name), then keep this rank's shard of them."""
    from megatron.core import parallel_state as ps

    ep_rank, ep_size = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            name = global_name(model, name)
            full_name, is_expert = name, ".local_experts." in name
            if is_expert:  # local expert i on EP rank r is global expert r * (E / ep) + i
                head, _, tail = name.partition(".local_experts.")
                local, _, rest = tail.partition(".")
                full_name = f"{head}.local_experts.{ep_rank * (EXPERTS // ep_size) + int(local)}.{rest}"
            if is_expert:
                tp_rank = ps.get_expert_tensor_parallel_rank()
                tp_size = ps.get_expert_tensor_parallel_world_size()
            else:
                tp_rank = ps.get_tensor_model_parallel_rank()
                tp_size = ps.get_tensor_model_parallel_world_size()
            shape = list(p.shape)
            split = getattr(p, "tensor_model_parallel", False) and tp_size > 1
            if split:
                shape[p.partition_dim] *= tp_size
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(full_name.encode()))
            if name.endswith("norm.weight"):  # layer norm gains near 1, everything else near 0
                full = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                full = 0.05 * torch.randn(shape, generator=gen)
            if split:
                full = full.chunk(tp_size, dim=p.partition_dim)[tp_rank]
            p.copy_(full)


def global_name(model: torch.nn.Module, name: str) -> str:
    """A parameter or module path of `model` with a pipeline stage's local layer index made global."""
    for prefix, module in model.named_modules():
        if (
            re.fullmatch(r"(.*\.)?layers\.\d+", prefix)
            and name.startswith(prefix + ".")
            and hasattr(module, "layer_number")
        ):
            return f"{prefix.rpartition('.')[0]}.{module.layer_number - 1}{name[len(prefix) :]}"
    return name


def perturb_routers(model: torch.nn.Module, seed: int = 1, scale: float = 1.0) -> None:
    """Add noise (scale x the weights' sd, drawn from `seed` and the router's global name) to every router's weights,
    so that pipeline stages perturb their routers as the unsplit model does."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.router"):
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name(model, name).encode()))
                module.weight.add_(scale * module.weight.std() * torch.randn(module.weight.shape, generator=gen))


def batch(b: int = 3, s: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [b, s], position_ids [b, s], a causal attention mask [b, 1, s, s] (True = masked) and labels."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s), generator=gen)
    labels = torch.randint(0, VOCAB, (b, s), generator=gen)
    position_ids = torch.arange(s).expand(b, s)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)
    return tokens, position_ids, mask, labels


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient, by name."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def micro_batch_routes(model: torch.nn.Module, micro: list[tuple[torch.Tensor, ...]]) -> list[Any]:
    """The routes of one recorded forward of `model` per micro-batch (tokens, position ids, mask, labels)."""
    from moe_replay.engines.megatron import record_routes

    routes = []
    for tokens, pos, mask, _ in micro:
        with record_routes(model) as rec:
            model(tokens, pos, mask)
        routes.append(rec.routes)
    return routes


def recompute_pair(
    identical: bool = False,
) -> tuple[torch.nn.Module, torch.nn.Module, list[tuple[torch.Tensor, ...]], list[Any]]:
    """(a model, the same model under full activation recompute, two micro-batches, their routes recorded on the
    first), both models' routers then perturbed so that a replay has to force the routes. `identical`: the two
    micro-batches hold the same tokens, and the second's routes differ from the first's at one position of the
    first layer (two equal GRPO answers that a rollout engine's batch-dependent kernels routed apart)."""
    from moe_replay import Routes

    plain = tiny_gpt()
    ckpt = tiny_gpt(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    micro = [batch(b=2, s=10, seed=0 if identical else s) for s in (0, 1)]
    routes = micro_batch_routes(plain, micro)
    if identical:
        indices = routes[0].indices.clone()
        indices[0, 5, 0] = torch.tensor([e for e in range(EXPERTS) if e not in indices[0, 5, 0].tolist()][:TOP_K])
        routes[1] = Routes(indices, routes[0].mask, routes[0].layers)
    for model in (plain, ckpt):
        perturb_routers(model)
    return plain, ckpt, micro, routes
