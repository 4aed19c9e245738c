"""A proxy in front of a real server that answers the first `allow` chat requests and holds every later one until it
is closed. A test that kills `generate` mid-run puts it between the two: the run then cannot finish before the kill,
however fast the server answers or however late the test's polling thread is scheduled on a loaded host (watching the
output file alone lost that race in CI: a taught model answered all 20 turns in 2 s)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from reliability_campaign import FakeServer  # noqa: E402


class GatedProxy(FakeServer):
    def __init__(self, target_root: str, allow: int) -> None:
        import aiohttp
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.forwarded = self.held = 0
        self.opened = opened = asyncio.Event()

        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            if request.path.endswith("/chat/completions"):
                if self.forwarded >= allow:
                    self.held += 1
                    await opened.wait()  # set by close(): the held request is refused, never forwarded
                    return web.json_response({"error": {"message": "proxy closed", "code": 503}}, status=503)
                self.forwarded += 1
            async with aiohttp.ClientSession() as s, s.request(request.method, target_root + request.path_qs,
                                                               data=body, headers={"content-type": "application/json"}
                                                               ) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self._start(app)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.opened.set)
        super().close()
