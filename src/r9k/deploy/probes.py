"""HTTP probes of a replica's api_server: /health (the heartbeat) and /metrics (text, read once per
probe: the page proof and the progress counters both come from it)."""
from __future__ import annotations

import asyncio

import aiohttp

METRICS_TIMEOUT_S = 5.0


class HttpProbe:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def heartbeat(self, url: str, timeout_s: float) -> bool:
        """/health answered 200 within ``timeout_s``."""
        try:
            async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def metrics_text(self, url: str, timeout_s: float = METRICS_TIMEOUT_S) -> str | None:
        """The /metrics body, or None if it did not answer 200 in time."""
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None
