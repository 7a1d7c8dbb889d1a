"""A stand-in for nats.micro's Request in endpoint tests (not a test file): the part of it that
services/endpoints.py uses, recording the answer."""

from __future__ import annotations

import anyio


class Req:
    """A request carrying `data` (no headers), answered once through `respond`."""

    def __init__(self, data: bytes = b"") -> None:
        self.data = data
        self.headers = None
        self.answer: bytes | None = None
        self.answered = anyio.Event()

    async def respond(self, data: bytes) -> None:
        self.answer = data
        self.answered.set()
