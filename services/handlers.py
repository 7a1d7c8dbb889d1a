"""Plumbing shared by the controller and worker endpoints.

A NATS handler never blocks: nats-py runs one subscription's callbacks one at a time, so
`Endpoints` acknowledges receipt by spawning the work as a task the service owns and
returns at once. The task replies when the work is done.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup
from nats.micro.request import Request

from rlbus.errors import Internal, RLBusError
from rlbus.schemas import UNDECODABLE_STATUS, AnyCommand, command_decoder, encode
from rlbus.schemas.codec import DecodeError

log = logging.getLogger("rlbus.services")

Reply = Callable[[], Awaitable[object]]
CommandHandler = Callable[[AnyCommand], Awaitable[object]]

MAX_PAYLOAD = 8 * 1024 * 1024


def decode_command(op: str, data: bytes) -> AnyCommand:
    """Decode and check the payload's kind matches the subject's op; raises DecodeError."""
    if len(data) > MAX_PAYLOAD:
        raise DecodeError(f"payload of {len(data)} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    cmd = command_decoder.decode(data or b'{"kind":"%s"}' % op.encode())
    tag = type(cmd).__struct_config__.tag
    if tag != op:
        raise DecodeError(f"payload kind {tag!r} does not match the subject's op {op!r}")
    return cmd


class ReplyCache:
    """Idempotency: answers by command id, so a retried command runs once."""

    def __init__(self, size: int = 512) -> None:
        self._done: OrderedDict[str, bytes] = OrderedDict()
        self._running: dict[str, anyio.Event] = {}
        self.size = size

    def __contains__(self, command_id: str) -> bool:
        """A command with this id is running (a duplicate must wait for it)."""
        return command_id in self._running

    async def run(self, command_id: str, work: Callable[[], Awaitable[bytes]]) -> bytes:
        if not command_id:
            return await work()
        if command_id in self._done:
            return self._done[command_id]
        while command_id in self._running:  # a duplicate arrived while the first runs
            await self._running[command_id].wait()
        if command_id in self._done:
            return self._done[command_id]
        ev = self._running[command_id] = anyio.Event()
        try:
            out = await work()
            self._done[command_id] = out
            while len(self._done) > self.size:
                self._done.popitem(last=False)
            return out
        finally:
            del self._running[command_id]
            ev.set()


class Endpoints:
    """Runs command handlers as tasks in the service's task group and replies for them."""

    def __init__(self, tg: TaskGroup, name: str) -> None:
        self._tg = tg
        self._name = name
        self._in_flight = 0
        self._idle = anyio.Event()
        self._idle.set()
        self.replies = ReplyCache()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def command(
        self, op: str, handler: CommandHandler, *, inline: bool | Callable[[AnyCommand], bool] = False
    ) -> Callable[[Request], Awaitable[None]]:
        """A micro endpoint handler for `op` that decodes, runs `handler` and replies.

        inline=True (or a predicate of the command) answers inside the NATS callback: only
        for handlers that will not wait (no lock, no I/O beyond their reply), where a task
        would cost more than the work.
        Everything else runs as a task the service owns, so the callback returns at once.
        """

        async def on_request(req: Request) -> None:
            try:
                cmd = decode_command(op, req.data)
            except DecodeError as e:
                await req.respond_error(UNDECODABLE_STATUS, f"undecodable {op} payload: {e}")
                return
            now = inline(cmd) if callable(inline) else inline
            if now and cmd.command_id not in self.replies:
                await self._reply(req, lambda: self._answer(handler, cmd), counted=False)
            else:
                self.spawn(req, lambda: self._answer(handler, cmd))

        return on_request

    def unknown(self, known: set[str]) -> Callable[[Request], Awaitable[None]]:
        """A catch-all endpoint for `<...>.*`: a typed 400 for an operation that does not exist.
        Known operations also arrive here; their own endpoint answers them."""

        async def on_request(req: Request) -> None:
            op = req.subject.rsplit(".", 1)[-1]
            if op not in known and req._msg.reply:
                await req.respond_error(UNDECODABLE_STATUS, f"unknown operation {op!r}; operations: {sorted(known)}")

        return on_request

    def spawn(self, req: Request, work: Callable[[], Awaitable[bytes]]) -> None:
        self._in_flight += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        self._tg.start_soon(self._reply, req, work)

    async def _answer(self, handler: CommandHandler, cmd: AnyCommand) -> bytes:
        async def work() -> bytes:
            try:
                return encode(await handler(cmd))
            except RLBusError as e:
                return encode(e.to_nack())
            except Exception as e:  # a bug: answer INTERNAL rather than leave the caller hanging
                log.exception("%s: %s failed", self._name, type(cmd).__name__)
                return encode(Internal(f"{self._name}: {type(e).__name__}: {e}").to_nack())

        return await self.replies.run(cmd.command_id, work)

    async def _reply(self, req: Request, work: Callable[[], Awaitable[bytes]], *, counted: bool = True) -> None:
        try:
            data = await work()
            try:
                await req.respond(data)
            except Exception as e:  # connection closed mid-reply: nothing else to tell
                log.warning("%s: could not reply: %s", self._name, e)
        finally:
            if counted:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.set()

