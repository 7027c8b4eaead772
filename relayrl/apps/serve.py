"""`relayrl serve`: the OpenAI-compatible server (relayrl/agents/openai_server.py) as a command."""

from __future__ import annotations

import sys
from typing import Any

from aiohttp import web

from relayrl.agents.openai_server import OpenAIServer
from relayrl.config.apps import ServeConfig
from relayrl.config.command_line import run_command
from relayrl.models.loading import load_pretrained, load_tokenizer, resolve_device
from relayrl.rollout.base import EngineSettings
from relayrl.rollout.build import build_engine, engine_capabilities


def _serve(cfg: ServeConfig) -> int:
    if not cfg.model:
        print("relayrl serve: --model PATH is required", flush=True)
        return 2
    import torch
    from transformers import AutoModelForCausalLM

    caps = engine_capabilities(cfg.engine)
    if caps.needs_gpu and cfg.device and torch.device(cfg.device).type != "cuda":
        print(
            f"relayrl serve: --engine {cfg.engine} runs on a GPU; --device {cfg.device} is not one",
            file=sys.stderr,
        )
        return 2
    device = resolve_device(cfg.device, "device")
    try:
        tokenizer = load_tokenizer(cfg.model, what="model")
        # an engine that loads its own weights (vllm) reads the folder itself: the HF module is not loaded then
        model: Any = cfg.model
        if not caps.own_weights:
            model = load_pretrained(AutoModelForCausalLM, cfg.model, what="model", device=device)
            model.eval().requires_grad_(False)  # never trained here: the native engine fuses its projections
    except (OSError, ValueError) as e:  # missing folder, not a causal LM, offline Hub id
        print(f"relayrl serve: cannot load model {cfg.model!r}: {e}", file=sys.stderr, flush=True)
        return 2
    settings = EngineSettings(
        max_seq_len=cfg.max_total_len or None,
        placement="alone",
        gpu_util=cfg.vllm_gpu_util,
        any_version=cfg.vllm_any_version,
    )
    engine = build_engine(cfg.engine, model, tokenizer, settings)
    name = cfg.model_name or cfg.model.rstrip("/").split("/")[-1]
    server = OpenAIServer(
        engine,
        tokenizer,
        model_name=name,
        max_total_len=cfg.max_total_len or None,
        tool_parser=cfg.tool_parser,
        max_request_bytes=int(cfg.max_request_mb * 1024**2),
        allow_client_chat_template=cfg.allow_client_chat_template,
    )
    print(
        f"relayrl serve: {name} on http://{cfg.host}:{cfg.port}/v1 (engine {cfg.engine}, context "
        f"{server.max_total_len} tokens)",
        flush=True,
    )
    try:
        web.run_app(server.app(), host=cfg.host, port=cfg.port, print=None, access_log=None)
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(ServeConfig, argv, "relayrl serve", _serve, description=(__doc__ or "").split("\n")[0])
