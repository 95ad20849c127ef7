"""Tools moe-replay plugs into (TRL's trainer, routes returned by vLLM and SGLang), one module each, imported lazily
so that each dependency stays optional. An integration builds on the engines; an engine never imports one.

`moe_replay.integrations.megatron` is a shim for `moe_replay.engines.megatron`.
"""
