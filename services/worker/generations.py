"""The generate requests a worker runs or ran lately, by request id (GenerateRequest.request_id).

A client sends a request again when its link to NATS came back, since a reply sent while the
link was down is lost (bus/replies.py). A send that reaches the worker still running that id
waits for the run; one that comes after it gets the run's reply, kept RECENT_S seconds (at most
RECENT_MAX replies); the client takes the first answer to any of its sends. The worker that takes a
request tells the caller its own subject (RESEND_TO_HEADER), so a send again reaches it rather
than the queue group; one that reaches another worker (the word was lost too, or the worker is
gone) runs there afresh. A send again of a request still running is told so (the same word),
since the run's reply goes to the reply subject every send of the SDK's call shares; the SDK
also asks again from time to time while no answer came (bus/replies.py: a reply lost on the
worker's own link leaves the caller nothing to notice). A request without an id runs on every
send.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

RECENT_S = 120.0
"""How long a reply is kept for a send that comes after its run (a link down longer than that
runs the request again)."""

RECENT_MAX = 1024
"""Replies kept at most (a 1,500-token reply is ~6 KB)."""


class Generations:
    """One worker's generate runs by request id: running, and answered lately."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._running: dict[str, asyncio.Future[bytes | None]] = {}
        """id -> the run's reply (None: it ended without one, the next send runs it)."""
        self._answered: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        """id -> (when, the reply), oldest first."""

    @property
    def running(self) -> int:
        return len(self._running)

    def runs(self, request_id: str) -> bool:
        """Whether this worker runs `request_id` now (its reply is still to come)."""
        return request_id in self._running

    def __contains__(self, request_id: str) -> bool:
        """Whether this worker runs `request_id` now or answered it lately."""
        return request_id in self._running or self.answered(request_id) is not None

    def answered(self, request_id: str) -> bytes | None:
        """The reply of a recent run of `request_id` (None: none kept)."""
        self._expire()
        got = self._answered.get(request_id)
        return got[1] if got is not None else None

    async def run(self, request_id: str | None, work: Callable[[], Awaitable[bytes | None]]) -> bytes | None:
        """`work`'s reply, or that of the run of `request_id` this worker has under way or
        answered lately. None: the run ended with no reply (`work` said so: the request was
        not started, and a send of it that waited here runs it), kept nowhere."""
        if request_id is None:
            return await work()
        while True:
            kept = self.answered(request_id)
            if kept is not None:
                return kept
            running = self._running.get(request_id)
            if running is None:
                break
            answer = await asyncio.shield(running)  # this send's cancellation leaves the run alone
            if answer is not None:
                return answer
        run: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()
        self._running[request_id] = run
        answer = None
        try:
            answer = await work()
        finally:
            del self._running[request_id]
            run.set_result(answer)  # None (not started, cancelled, or a bug raised): a waiting send runs it
        if answer is not None:
            self._answered[request_id] = (self._clock(), answer)
            self._expire()
        return answer

    def _expire(self) -> None:
        old = self._clock() - RECENT_S
        while self._answered and (len(self._answered) > RECENT_MAX or next(iter(self._answered.values()))[0] < old):
            self._answered.popitem(last=False)
