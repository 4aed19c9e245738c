"""Proxies in front of a real server that change what a client sees of it, for the tests of `generate`.

- `GatedProxy` answers the first `allow` chat requests and holds every later one until it is closed. A test that kills
  `generate` mid-run puts it between the two: the run then cannot finish before the kill, however fast the server
  answers or however late the test's polling thread is scheduled on a loaded host (watching the output file alone lost
  that race in CI: a taught model answered all 20 turns in 2 s).
- `FlakyProxy` answers 503 to the first chat request and every third after it, to exercise retries."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from reliability_campaign import FakeServer  # noqa: E402


def _refusal(message: str) -> Any:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": 503}}, status=503)


class ForwardingProxy(FakeServer):
    """Forwards every request to `target_root`; `on_chat` may answer a chat request itself instead."""

    def __init__(self, target_root: str) -> None:
        import aiohttp
        from aiohttp import web

        self.loop = asyncio.new_event_loop()

        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            if request.path.endswith("/chat/completions"):
                answer = await self.on_chat()
                if answer is not None:
                    return answer
            async with aiohttp.ClientSession() as s, s.request(request.method, target_root + request.path_qs,
                                                               data=body, headers={"content-type": "application/json"}
                                                               ) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self._start(app)

    async def on_chat(self) -> Any:
        return None


class GatedProxy(ForwardingProxy):
    def __init__(self, target_root: str, allow: int) -> None:
        self.allow, self.forwarded, self.held = allow, 0, 0
        self.opened = asyncio.Event()
        super().__init__(target_root)

    async def on_chat(self) -> Any:
        if self.forwarded >= self.allow:
            self.held += 1
            await self.opened.wait()  # set by close(): the held request is refused, never forwarded
            return _refusal("proxy closed")
        self.forwarded += 1
        return None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.opened.set)
        super().close()


class FlakyProxy(ForwardingProxy):
    """Failing the first chat request makes a resume test independent of how much the killed run had done: the
    least-busy pool sends the resumed run's first request to this endpoint."""

    def __init__(self, target_root: str) -> None:
        self.count = self.failed = 0
        super().__init__(target_root)

    async def on_chat(self) -> Any:
        self.count += 1
        if self.count % 3 == 1:
            self.failed += 1
            return _refusal("overloaded")
        return None
