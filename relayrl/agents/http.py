"""The HTTP bootstrap shared by the servers (`relayrl serve`'s OpenAIServer, `relayrl serve-rm`'s app).

runner, port = await start_app(app, host="127.0.0.1", port=0)     port 0: a free port; returns the bound one
...
await runner.cleanup()
"""

from __future__ import annotations

from aiohttp import web


async def start_app(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Start `app` on host:port (0 = a free port) in the running loop; returns (runner, bound port)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []  # aiohttp has no public getter
    return runner, int(sockets[0].getsockname()[1]) if sockets else port
