"""`relayrl serve-rm`: a reward model (or reward_func file) served over HTTP (relayrl/agents/remote_rm.py) as a command."""

from __future__ import annotations

import sys

from aiohttp import web

from relayrl.agents.remote_rm import Scorer, build_rm_app, model_scorer
from relayrl.agents.rewards.func import load_reward_func
from relayrl.agents.rewards.local_rm import LocalRewardModel
from relayrl.config.apps import ServeRMConfig
from relayrl.config.command_line import run_command


def _build_scorer(cfg: ServeRMConfig) -> Scorer:
    if bool(cfg.model) == bool(cfg.reward_func):
        raise SystemExit("relayrl serve-rm: give exactly one of --model PATH or --reward-func FILE.py")
    if cfg.reward_func:
        return load_reward_func(cfg.reward_func)

    rm = LocalRewardModel.from_pretrained(
        cfg.model, device=cfg.device or None, batch_size=cfg.batch_size, max_len=cfg.max_len
    )
    return model_scorer(rm)


def _serve(cfg: ServeRMConfig) -> int:
    try:
        scorer = _build_scorer(cfg)
    except SystemExit as e:
        print(e, flush=True)
        return 2
    except (OSError, ImportError, AttributeError, ValueError) as e:  # a missing / broken model or file
        print(
            f"relayrl serve-rm: cannot load {cfg.model or cfg.reward_func!r}: {e}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    print(f"relayrl serve-rm: listening on http://{cfg.host}:{cfg.port}/get_reward", flush=True)
    concurrency = cfg.max_concurrency if cfg.reward_func else 1  # a model scores one batch at a time
    app = build_rm_app(scorer, timeout=cfg.timeout, max_concurrency=concurrency)
    web.run_app(app, host=cfg.host, port=cfg.port, print=None, access_log=None)
    return 0


def main(argv: list[str] | None = None) -> int:

    return run_command(
        ServeRMConfig, argv, "relayrl serve-rm", _serve, description=(__doc__ or "").split("\n")[0]
    )
