"""Tools moe-replay plugs into, one module each, imported lazily so that each dependency stays optional:

- `moe_replay.integrations.trl`: `RoutingReplayGRPOTrainer`, TRL's GRPOTrainer with `routing_replay` (the `[trl]`
  extra);
- `moe_replay.integrations.vllm` / `.sglang` / `.megatron_inference`: `routes_from_vllm` / `routes_from_sglang` /
  `routes_from_megatron_inference`, the routes those engines return as `Routes` (no engine dependency: they read the
  engines' outputs).

An integration builds on the engines; an engine never imports one. `moe_replay.integrations.megatron` is deprecated:
its names warn and are `moe_replay.engines.megatron`'s.
"""
