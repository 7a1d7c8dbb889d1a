"""Plumbing shared by the controller and worker endpoints: handlers registered by command
type (`Routes`), and `Endpoints`, which serves them.

A NATS handler never blocks: nats-py runs one subscription's callbacks one at a time, so
`Endpoints` acknowledges receipt by spawning the work as a task the service owns and
returns at once. The task replies when the work is done.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any, Generic, Literal, Protocol, TypeVar

import anyio
import msgspec
import xxhash
from anyio.abc import TaskGroup
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request, ServiceError
from nats.micro.service import Group
from rlbus.schemas import (
    FIRST_SEND_HEADER,
    MAX_COMMAND_BYTES,
    UNDECODABLE_STATUS,
    Aborted,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    Message,
    RLBusError,
    WorkerAck,
    encode,
    op_of,
)
from rlbus.schemas.codec import DecodeError, ValidationError, error_path, invalid_field

log = logging.getLogger("rlbus.services")

C = TypeVar("C", bound=Message)

Handler = Callable[[Any], Awaitable[object]]
Gate = Callable[["Route[Any]", Any], Awaitable[None]]
"""Runs before a command is answered from the reply cache or claimed in its store (after a send of
the same command already running has finished: its sends share one outcome); raises an
RLBusError to refuse it, which is recorded nowhere."""

Beside = bool | Literal["first_send"]
"""When a route's claim lands beside its handler (Route.claims_beside)."""

REPLY_MARGIN_S = 0.2
"""A command with a deadline is answered this long before it, so the answer reaches the caller."""


class Route(Generic[C]):
    """One command type's handler. inline=True (or a predicate of the command) answers inside
    the NATS callback: only for handlers that will not wait (no lock, no I/O beyond their
    reply), where a task would cost more than the work."""

    def __init__(
        self,
        kind: type[C],
        handler: Callable[[C], Awaitable[object]],
        inline: bool | Callable[[C], bool],
        read: bool,
        recover: Callable[[C], Awaitable[object | None]] | None = None,
        claims_beside: Beside = False,
    ) -> None:
        self.kind = kind
        self.recover = recover
        self.claims_beside = claims_beside
        """Its claim in the answer store is sent as it starts and lands beside its handler's first
        fan-out, not before it: the handler awaits it (`claimed`) before its first step that
        cannot be undone, and undoes what it did when the claim is refused or finds an earlier
        run (a finish: its prepare checks only, and nothing is decided before the claim lands).
        "first_send": only on a send that says it is its id's first (FIRST_SEND_HEADER), which no
        earlier run can precede: for a command whose run could not be taken back were it a
        retry's second run (a pause's abort), and that is taken back when its claim is refused."""
        """Answers a retry of a command whose run stopped with its process before it answered,
        from the state that run left (e.g. a finish whose commit a successor completed)."""
        self.op = op_of(kind)
        self.handler = handler
        self.inline = inline
        self.read = read
        """Changes nothing: its answers need not outlive the process."""
        self.decoder = msgspec.json.Decoder(kind)
        """This command alone, the route's one decoder: `kind` may be left out on its own subject."""

    def runs_inline(self, cmd: C) -> bool:
        return self.inline(cmd) if callable(self.inline) else self.inline

    def beside(self, req: Request) -> bool:
        """This send's claim lands beside its handler (see claims_beside)."""
        if self.claims_beside == "first_send":
            headers = req.headers
            return headers is not None and headers.get(FIRST_SEND_HEADER) == "1"
        return self.claims_beside

    def recovery(self, cmd: C) -> Callable[[], Awaitable[bytes | None]] | None:
        recover = self.recover
        if recover is None:
            return None

        async def answer() -> bytes | None:
            out = await recover(cmd)
            return encode(out) if out is not None else None

        return answer


class Routes:
    """A service's one dispatch table: handlers registered by command type. The op (the
    subject's last token) is the type's wire tag, so adding an op is one `add`."""

    def __init__(self) -> None:
        self._by_op: dict[str, Route[Any]] = {}

    def add(
        self,
        kind: type[C],
        handler: Callable[[C], Awaitable[object]],
        *,
        inline: bool | Callable[[C], bool] = False,
        read: bool = False,
        recover: Callable[[C], Awaitable[object | None]] | None = None,
        claims_beside: Beside = False,
    ) -> None:
        if claims_beside and inline is not False:
            raise ValueError(f"{op_of(kind)}: a command answered inline cannot claim beside its handler")
        route = Route(kind, handler, inline, read, recover, claims_beside)
        if route.op in self._by_op:
            raise ValueError(f"{route.op} is routed twice")
        self._by_op[route.op] = route

    def __iter__(self) -> Iterator[Route[Any]]:
        return iter(self._by_op.values())

    def ops(self) -> set[str]:
        return set(self._by_op)

    def decode(self, op: str, data: bytes) -> Message:
        """Decode the command the subject names, once, with its route's typed decoder. The
        payload is a JSON object of at most MAX_COMMAND_BYTES; its `kind` may be left out (the
        subject names the op) and must match when present; an empty payload is the command
        with every default.

        Raises DecodeError (answered with a 400) for a payload that is not this op's command
        at all (too large, not JSON, not an object, another kind), and InvalidArgument (a typed
        refusal) for one whose field holds a wrong value or lacks a required one, naming what
        it allows."""
        route = self._by_op[op]
        if len(data) > MAX_COMMAND_BYTES:
            raise DecodeError(
                f"a {op} payload of {len(data)} bytes is over the limit of {MAX_COMMAND_BYTES} bytes (8 MiB)"
            )
        try:
            return route.decoder.decode(data or b"{}")
        except ValidationError as e:
            where = error_path(e)
            if where == ".kind":
                raise DecodeError(f"payload kind does not match the subject's op {op!r} ({e})") from None
            if where == "" and str(e).startswith("Expected `object`"):
                raise DecodeError(f"a {op} payload must be a JSON object") from None
            raise InvalidArgument(invalid_field(route.kind, e)) from None
        except DecodeError:
            raise DecodeError(f"a {op} payload must be a JSON object") from None


class StoredReply(msgspec.Struct, frozen=True):
    """An answer as the reply cache keeps it: what it answered, and the answer."""

    fingerprint: str
    """The op and a digest of the payload: a reused id must resend the same command."""
    reply: bytes
    answered: bool = True
    """False: the command started (kept before it runs) and its answer was never kept: the
    process that ran it died. A retry is refused (ABORTED), never run a second time."""
    claim: str = ""
    """A token of the run that kept it started: a claim whose write landed but whose
    acknowledgement was lost (a stalled event loop timed it out) and was sent again finds its
    own record, not a dead run's."""


class DurableReplies(Protocol):
    """Where answers outlive the process (the controller: a KV bucket with a TTL)."""

    async def claim(self, command_id: str, running: StoredReply) -> StoredReply | None:
        """Keep `running` under the id unless the id holds something: then return that."""
        ...

    async def put(self, command_id: str, stored: StoredReply) -> Callable[[], Awaitable[None]]:
        """Keep `stored`: sent when this returns, ahead of anything sent after it (the reply);
        the call returned waits for the store's acknowledgement."""
        ...


Acked = Callable[[], Awaitable[object]]
"""Waits for the store to acknowledge a write that was sent ahead."""

_after_reply: ContextVar[list[Acked] | None] = ContextVar("rlbus_after_reply", default=None)
"""The command being answered's writes sent ahead of its reply (None outside a command)."""


class ClaimOutcome(Exception):
    """A claim sent beside its handler did not let the command run: the handler undid what it
    did (nothing it did could not be undone) and gives way; the reply cache answers."""


class ClaimRefused(ClaimOutcome):
    """The store took no claim (no quorum within its patience): the refusal answers the call
    and is recorded nowhere, as a claim refused before its handler ran."""


class ClaimFound(ClaimOutcome):
    """The id holds an earlier run's record: that run's answer (or its recovery) answers."""


_beside: ContextVar[asyncio.Future[StoredReply | None] | None] = ContextVar("rlbus_claim_beside", default=None)
"""The running command's claim, when its route claims beside its handler (None otherwise)."""


async def claimed() -> None:
    """In a handler: wait until its command's claim (sent as it started, when its route claims
    beside it) has landed; at once when it was claimed before it ran. Call it before the first
    step that cannot be undone. Raises ClaimRefused or ClaimFound: undo what was done, let it
    through. The claim is not cancelled with the caller: the reply cache waits for its end."""
    pending = _beside.get()
    if pending is None:
        return
    try:
        found = await asyncio.shield(pending)
    except RLBusError as e:
        raise ClaimRefused(str(e)) from None
    if found is not None:
        raise ClaimFound(found.fingerprint)


def logged(acked: Acked, what: str) -> Callable[[], Awaitable[None]]:
    """`acked`, awaited after a reply that already stood: a store that refused the write is
    logged naming `what`, never raised."""

    async def wait() -> None:
        try:
            await acked()
        except Exception as e:
            log.warning("%s was not kept in the state store: %s", what, e)

    return wait


async def after_reply(acked: Acked, what: str) -> None:
    """A write the handler sent ahead of its command's reply: its acknowledgement is awaited
    once the reply is out (with the answer's, see ReplyCache.settle; a drain waits for it), and
    a store that refused it is logged naming `what`. Outside a command whose answer is kept
    durably (a takeover, a read, a test) it is awaited now, and a refusal raises."""
    pending = _after_reply.get()
    if pending is None:
        await acked()
    else:
        pending.append(logged(acked, what))


def fingerprint(op: str, data: bytes) -> str:
    """The op and a 128-bit digest of the payload (xxh3: a retry's check, not a signature)."""
    return f"{op}:{xxhash.xxh3_128_hexdigest(data)}"


class _Running:
    """A command running under its id: what it is, the Event a duplicate waits on (made by
    the first duplicate: most commands have none, and an Event costs more than the dedup), and
    the refusal its gate or claim ended in, which the duplicates that waited on it answer too."""

    __slots__ = ("fingerprint", "done", "refused")

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.done: anyio.Event | None = None
        self.refused: RLBusError | None = None


class ReplyCache:
    """Idempotency: answers by command id, so a retried command runs once.

    A retry must be the same command: the same id with another op or payload is refused
    (INVALID_ARGUMENT naming the conflict) instead of answered with the first command's
    reply. With a durable store, answers of state-changing commands also survive a restart,
    so a retry that reaches the next controller gets the first answer."""

    def __init__(self, size: int = 512, durable: DurableReplies | None = None) -> None:
        self._done: OrderedDict[str, StoredReply] = OrderedDict()
        self._running: dict[str, _Running] = {}
        self._unacked: dict[str, list[Acked]] = {}
        """Writes sent to the store ahead of a command's reply (its answer, and what its handler
        passed to after_reply), whose acknowledgements are awaited after it."""
        self.size = size
        self.durable = durable

    def __contains__(self, command_id: str) -> bool:
        """A command with this id is running (a duplicate must wait for it)."""
        return command_id in self._running

    def _check(self, command_id: str, print_: str, seen: str) -> None:
        if seen != print_:
            raise InvalidArgument(
                f"command id {command_id!r} was first used for {seen.split(':')[0]} with another payload; "
                "a retry must resend the same command, a new command needs a new id"
            )

    def _kept(self, command_id: str, print_: str) -> bytes | None:
        """The answer kept in memory under the id (the same command's, else InvalidArgument)."""
        kept = self._done.get(command_id)
        if kept is None:
            return None
        self._check(command_id, print_, kept.fingerprint)
        return kept.reply

    def _keep(self, command_id: str, stored: StoredReply) -> None:
        self._done[command_id] = stored
        while len(self._done) > self.size:
            self._done.popitem(last=False)

    def _release(self, command_id: str) -> None:
        """The id's run ended: the sends that waited on it go on."""
        done = self._running.pop(command_id).done
        if done is not None:
            done.set()

    async def run_in_memory(self, command_id: str, print_: str, work: Callable[[C], Awaitable[bytes]], cmd: C) -> bytes:
        """`run` of `work(cmd)` for a command whose answer is kept in memory only, with no gate,
        and no other send of its id running (the caller checked `in`): one lookup, the work, one
        keep (the hot path of every worker command, answered inline)."""
        if not command_id:
            return await work(cmd)
        kept = self._kept(command_id, print_)
        if kept is not None:
            return kept
        self._running[command_id] = _Running(print_)
        try:
            answer = await work(cmd)
            self._keep(command_id, StoredReply(print_, answer))
            return answer
        finally:
            self._release(command_id)

    async def run(
        self,
        command_id: str,
        print_: str,
        work: Callable[[], Awaitable[bytes]],
        *,
        durable: bool = False,
        recover: Callable[[], Awaitable[bytes | None]] | None = None,
        gate: Callable[[], Awaitable[None]] | None = None,
        beside: bool = False,
    ) -> bytes:
        """The answer of `work`, run once per command id. `durable`: also keep it in the
        durable store (state-changing commands). A command that was running when the process
        serving it stopped is not run again: `recover` may answer it from the state it left
        (None, or no `recover`: ABORTED, saying so). `gate` runs first and may refuse it (an
        RLBusError, recorded nowhere).

        Sends of one command that arrive while it runs wait for it and share its outcome, a
        refusal included: a trainer resends a command its first send has not answered within an
        attempt (5 s), and a refusal (the state store without quorum for its 15 s patience)
        answers the call; a resend that started over behind it could run the command after its
        caller was told it was refused.

        `beside` (durable only): the claim is sent as `work` starts and awaited by it (`claimed`)
        before its first step that cannot be undone, then here: its refusal or an earlier run's
        record answers instead of `work`, which undid what it did."""
        if not command_id:
            if gate is not None:
                await gate()
            return await work()
        while command_id in self._running:  # a duplicate arrived while the first runs
            first = self._running[command_id]
            self._check(command_id, print_, first.fingerprint)
            if first.done is None:
                first.done = anyio.Event()
            await first.done.wait()
            if first.refused is not None:
                raise first.refused
        self._running[command_id] = running_now = _Running(print_)
        try:
            try:
                if gate is not None:
                    await gate()
                kept = self._kept(command_id, print_)
                if kept is not None:
                    return kept
                store = self.durable if durable else None
                stored: StoredReply | None = None
                claiming: asyncio.Future[StoredReply | None] | None = None
                if store is not None:  # kept before it runs (claimed): a retry after a crash mid-run is not run again
                    running = StoredReply(print_, b"", answered=False, claim=secrets.token_hex(8))
                    if beside:  # sent now, landing while the handler runs: it awaits it before it decides
                        claiming = asyncio.ensure_future(store.claim(command_id, running))
                    else:
                        stored = await store.claim(command_id, running)
            except RLBusError as e:
                running_now.refused = e
                raise
            answer = b""
            pending: list[Acked] = []
            if claiming is not None:
                answer, stored = await self._run_beside(claiming, work, pending, running_now)
            if stored is not None:
                self._check(command_id, print_, stored.fingerprint)
                if not stored.answered:
                    recovered = await _recovered(recover)
                    stored = StoredReply(
                        print_,
                        recovered
                        or encode(
                            Aborted(
                                f"command {command_id!r} ({print_.split(':')[0]}) was running when the process serving it "
                                "stopped, before it answered; it is not run twice: read the state (server_info, "
                                "get_weight_version) to see what it did"
                            ).to_nack()
                        ),
                    )
            elif store is None:  # kept in memory only: what its handler sends ahead is awaited in it
                stored = StoredReply(print_, await work())
            else:
                if claiming is None:
                    token = _after_reply.set(pending)
                    try:
                        answer = await work()
                    finally:
                        _after_reply.reset(token)
                stored = StoredReply(print_, answer)
                # kept before it is sent: its write goes out ahead of the reply on the one
                # connection, so the server has it before the caller can; settle() awaits the
                # store's acknowledgement once the reply is out
                pending.append(await store.put(command_id, stored))
                self._unacked[command_id] = pending
            self._keep(command_id, stored)
            return stored.reply
        finally:
            self._release(command_id)

    @staticmethod
    async def _run_beside(
        claiming: asyncio.Future[StoredReply | None],
        work: Callable[[], Awaitable[bytes]],
        pending: list[Acked],
        running_now: _Running,
    ) -> tuple[bytes, StoredReply | None]:
        """Run `work` while its claim lands; then the claim's outcome: an earlier run's record
        (the answer is dropped: `work` did nothing it did not undo) or none (the answer stands).
        A refused claim raises its refusal, shared by the sends that waited."""
        token, beside = _after_reply.set(pending), _beside.set(claiming)
        answer = b""
        try:
            answer = await work()
        except ClaimOutcome:
            pass  # the claim's outcome answers: read below
        except BaseException:  # cancelled: the claim goes too
            claiming.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(claiming, return_exceptions=True)
            raise
        finally:
            _beside.reset(beside)
            _after_reply.reset(token)
        try:
            return answer, await claiming
        except RLBusError as e:
            running_now.refused = e
            raise

    def unsettled(self, command_id: str) -> bool:
        return bool(command_id) and command_id in self._unacked

    async def settle(self, command_id: str) -> None:
        """After the reply: wait for the store to acknowledge what was sent ahead of it."""
        for acked in self._unacked.pop(command_id, ()) if command_id else ():
            await acked()


async def _recovered(recover: Callable[[], Awaitable[bytes | None]] | None) -> bytes | None:
    if recover is None:
        return None
    try:
        return await recover()
    except Exception as e:  # the state cannot say: the caller is told the command was not run twice
        log.warning("could not answer a command its last run left unanswered: %s", e)
        return None


PARKED_RUNNERS = 16
"""Handler tasks kept waiting for the next command once theirs answered. Handing a command to
one costs an Event (~2 us); starting a task in an anyio task group costs ~30 us (measured on
these machines), which at 64 workers is a tenth of a session's commit fan-out."""


class Reply(msgspec.Struct, frozen=True):
    """An answer sent with headers (a spawned job's work may return one instead of bytes)."""

    data: bytes
    headers: dict[str, str] | None = None


_Job = tuple[Request, Callable[[], Awaitable["bytes | Reply"]], str]
"""A request to answer: the request, the work that makes the answer, its command id."""


class _Parked:
    """A runner waiting for its next command."""

    __slots__ = ("job", "wake")

    def __init__(self) -> None:
        self.job: _Job | None = None
        self.wake = anyio.Event()


class Endpoints:
    """Runs command handlers as tasks in the service's task group and replies for them. A task
    whose command answered waits for the next one (up to PARKED_RUNNERS of them), so a busy
    service starts few tasks; all of them belong to the service's task group."""

    def __init__(self, tg: TaskGroup, name: str, durable: DurableReplies | None = None) -> None:
        self._tg = tg
        self._name = name
        self._in_flight = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._parked: list[_Parked] = []
        self.replies = ReplyCache(durable=durable)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def serve(
        self,
        group: Group,
        routes: Routes,
        wrap: Callable[[Handler], Handler] | None = None,
        gate: Gate | None = None,
    ) -> None:
        """One micro endpoint per route in `group`; `wrap` may put code around each handler.
        `gate` runs before a command touches the reply cache (fencing: a controller that does
        not lead refuses without recording an answer under the command's id, so the leader's
        answer to the same id is the one that stands)."""
        for route in routes:
            reply = getattr(route.kind, "reply", WorkerAck)  # control commands declare theirs
            await group.add_endpoint(
                name=route.op,
                subject=route.op,
                handler=self._endpoint(routes, route, wrap, gate),
                metadata={
                    "request": route.op,
                    "reply": reply.__struct_config__.tag,
                    "schemas": "rlbus schema --out DIR; docs/protocol.md",
                },
            )

    def _endpoint(
        self, routes: Routes, route: Route[Any], wrap: Callable[[Handler], Handler] | None, gate: Gate | None = None
    ) -> Callable[[Request], Awaitable[None]]:
        """Decodes, runs the handler (inline, or as a task the service owns) and replies."""
        handler = wrap(route.handler) if wrap is not None else route.handler
        handled = self._handled(route, handler)
        op = route.op
        # kept in memory only and let through by no gate (a worker's commands): the reply
        # cache's short path
        in_memory = gate is None and route.recover is None and (route.read or self.replies.durable is None)

        async def on_request(req: Request) -> None:
            try:
                cmd = routes.decode(op, req.data)
            except RLBusError as e:
                await req.respond(encode(e.to_nack()))
                return
            except DecodeError as e:
                # raised, not answered: the micro service answers it and counts it in num_errors
                raise ServiceError(UNDECODABLE_STATUS, f"undecodable {op} payload: {e}") from None
            print_ = fingerprint(op, req.data)
            command_id: str = cmd.command_id  # type: ignore[attr-defined]
            if route.runs_inline(cmd) and command_id not in self.replies:
                # answered here, in the NATS callback: no task, no closure (the hot path of
                # every worker command)
                if in_memory:
                    try:
                        answer = await self.replies.run_in_memory(command_id, print_, handled, cmd)
                    except RLBusError as e:  # the id used for another command
                        answer = encode(e.to_nack())
                    await self.send(req, answer)
                    return
                await self.send(req, await self._answer(route, handled, cmd, print_, gate))
                if self.replies.unsettled(command_id):  # never wait inside the callback
                    self._tg.start_soon(self.replies.settle, command_id)
            else:
                beside = route.beside(req)
                self.spawn(req, lambda: self._answer(route, handled, cmd, print_, gate, beside), command_id)

        return on_request

    @staticmethod
    def unknown(nc: Client, known: set[str]) -> Callable[[Msg], Awaitable[None]]:
        """A catch-all subscription for `<...>.*`: a 400 for an operation that does not exist.
        Known operations also arrive here (their own endpoint answers them), so it is a plain
        subscription, not a micro endpoint: the service's stats count only real requests."""

        async def on_message(msg: Msg) -> None:
            op = msg.subject.rsplit(".", 1)[-1]
            if op not in known and msg.reply:
                await nc.publish(
                    msg.reply,
                    b"",
                    headers={
                        "Nats-Service-Error": f"unknown operation {op!r}; operations: {sorted(known)}",
                        "Nats-Service-Error-Code": UNDECODABLE_STATUS,
                    },
                )

        return on_message

    def spawn(self, req: Request, work: Callable[[], Awaitable[bytes | Reply]], command_id: str = "") -> None:
        """Run `work` and reply with its answer, in a task of the service's (a parked one if any)."""
        job: _Job = (req, work, command_id)
        if self._parked:
            parked = self._parked.pop()  # the most recently parked: its stack is warm
            parked.job = job
            parked.wake.set()
        else:
            self._tg.start_soon(self._runner, job)
        self._in_flight += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle

    async def _runner(self, job: _Job) -> None:
        """Answer `job`, then each command handed to this task while it is parked."""
        while True:
            req, work, command_id = job
            await self._reply(req, work, command_id)
            if len(self._parked) >= PARKED_RUNNERS:
                return
            parked = _Parked()
            self._parked.append(parked)
            try:
                await parked.wake.wait()
            finally:
                if parked.job is None and parked in self._parked:  # cancelled while parked
                    self._parked.remove(parked)
            assert parked.job is not None
            job = parked.job

    def _handled(self, route: Route[Any], handler: Handler) -> Callable[[Any], Awaitable[bytes]]:
        """`handler`'s answer to a command, encoded: a refusal as its nack, a command with a
        deadline answered before it, a bug as INTERNAL (never a caller left hanging)."""
        op, name = route.op, self._name

        async def handled(cmd: Any) -> bytes:
            budget = getattr(cmd, "timeout_s", None)
            try:
                # answer before the sender stops waiting: a late answer only holds the lock
                if budget is None:  # worker commands: bounded by the controller's fan-out
                    return encode(await handler(cmd))
                with anyio.fail_after(max(0.0, budget - REPLY_MARGIN_S)):
                    return encode(await handler(cmd))
            except TimeoutError:
                return encode(
                    DeadlineExceeded(
                        f"{op} did not finish within the caller's {budget:g}s; what it started was undone"
                    ).to_nack()
                )
            except RLBusError as e:
                return encode(e.to_nack())
            except ClaimOutcome:  # the reply cache answers from the claim
                raise
            except Exception as e:  # a bug: answer INTERNAL rather than leave the caller hanging
                log.exception("%s: %s failed", name, type(cmd).__name__)
                return encode(Internal(f"{name}: {type(e).__name__}: {e}").to_nack())

        return handled

    async def _answer(
        self,
        route: Route[Any],
        handled: Callable[[Any], Awaitable[bytes]],
        cmd: Any,
        print_: str,
        gate: Gate | None = None,
        beside: bool = False,
    ) -> bytes:
        """Run the command once per id (the reply cache), after `gate` let it through: a gate's
        refusal is recorded nowhere, and answers the sends of the command that waited on it."""
        try:
            return await self.replies.run(
                cmd.command_id,
                print_,
                lambda: handled(cmd),
                durable=not route.read,
                recover=route.recovery(cmd),
                gate=None if gate is None else lambda: gate(route, cmd),
                beside=beside,
            )
        except RLBusError as e:  # refused by the gate, the id used for another command, no claim
            return encode(e.to_nack())
        except Exception as e:  # a bug in the store's handling: answered INTERNAL, the service serves on
            log.exception("%s: %s: keeping its answer failed", self._name, type(cmd).__name__)
            return encode(Internal(f"{self._name}: {type(e).__name__}: {e}").to_nack())

    async def send(self, req: Request, data: bytes | Reply) -> None:
        """Answer `req` (with headers for a Reply); a closed connection is logged, never raised."""
        try:
            if isinstance(data, Reply):
                await req.respond(data.data, headers=data.headers)
            else:
                await req.respond(data)
        except Exception as e:  # connection closed mid-reply: nothing else to tell
            log.warning("%s: could not reply: %s", self._name, e)

    async def _reply(self, req: Request, work: Callable[[], Awaitable[bytes | Reply]], command_id: str = "") -> None:
        """Run `work`, reply with its answer, then wait for the durable store to acknowledge the
        answer it was sent ahead of the reply (a drain waits for that too)."""
        try:
            await self.send(req, await work())
            await self.replies.settle(command_id)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()


class NotRunning:
    """A service's task group before run(): nothing may be spawned yet."""

    def start_soon(self, *a: object, **k: object) -> None:
        raise RuntimeError("the service is not running")
