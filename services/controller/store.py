"""Durable controller state in a JetStream KV bucket: epoch, committed versions, open session,
the last decided commit, the push lease.

Keys (schemas.subjects.KvKey): the epoch (fencing counter, advanced with revision checks),
the committed version (a VersionInfo), the open session (JSON: its id, or null), the last
commit decision (a CommitDecision), the push lease (a PushLease, or null when free).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionReconnectingError, NoRespondersError, StaleConnectionError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import KeyValueConfig, PubAck, StorageType
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue
from rlbus.schemas import (
    DEFAULT_VERSION,
    CommitDecision,
    FleetState,
    KvKey,
    PushLease,
    Unavailable,
    VersionInfo,
    encode,
    version_decoder,
)
from rlbus.services.endpoints import StoredReply, after_reply, logged

log = logging.getLogger("rlbus.controller.store")

OPEN_PATIENCE_S = 30.0
"""How long opening a bucket waits for JetStream to be ready (a cluster's first seconds)."""
PATIENCE_S = 15.0
"""How long a state store call rides out a stream without a leader: after a NATS node is lost
the survivors elect one within seconds (about 5 s measured; an election timeout is 4-9 s), and
the connection moves to a survivor. Longer than that, the stream has no quorum."""
T = TypeVar("T")


class StateStore:
    """The controller's durable state. Every write is a JetStream KV put (file storage).

    Every call is guarded: a write that finds the bucket gone (deleted, or the server lost its
    storage) recreates it, lets the controller write back what it holds in memory
    (`on_lost`), and retries once; a stream without a leader (a NATS node lost, its connection
    moving to a survivor) is retried for `patience_s`, then UNAVAILABLE saying the store has no
    quorum; any other NATS failure is UNAVAILABLE naming the store, never an untyped NATS exception."""

    def __init__(self, nc: Client, kv: KeyValue, config: KeyValueConfig, patience_s: float = PATIENCE_S) -> None:
        self.nc = nc
        self.kv = kv
        self.config = config
        self.patience_s = patience_s
        """How long a call retries while the bucket's stream has no leader, then UNAVAILABLE: no quorum."""
        self.on_lost: Callable[[], Awaitable[None]] | None = None
        """Called once the bucket was recreated after a loss: write back the state."""
        self._recovering = False
        self._writes = 0
        self._latest: dict[str, int] = {}
        """Per key, the number of the last put issued to it: a put sent again after its reply
        (put_ahead) is dropped once a newer one was issued, so it never undoes it."""

    @classmethod
    async def open(
        cls, nc: Client, bucket: str, replicas: int | None = None, patience_s: float = PATIENCE_S
    ) -> StateStore:
        """Open (or create) the bucket; `replicas` defaults to min(3, the cluster's size)."""
        config = KeyValueConfig(
            bucket=bucket,
            history=16,
            storage=StorageType.FILE,
            description="rlbus controller state",
            replicas=replicas or default_replicas(nc),
        )
        try:
            kv = await _open_bucket(nc, config)
        except Exception as e:
            raise Unavailable(
                f"the state store (KV bucket {bucket}) cannot be opened: {type(e).__name__}: {e}"
            ) from None
        return cls(nc, kv, config, patience_s)

    async def _guard(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.patience_s
        while True:
            try:
                # one attempt never outlasts the patience (a JetStream request waits 5 s by itself)
                with anyio.fail_after(max(deadline - time.monotonic(), 0.5)):
                    return await call()
            except NoStreamResponseError:
                if self._recovering:
                    raise Unavailable(
                        f"the state store (KV bucket {self.config.bucket}) vanished again while recovering"
                    ) from None
                if not await self._bucket_exists():
                    await self._recover()
                    return await call()
                fault = "no stream leader answered"  # the bucket is there: its leader moves, or it has no quorum
            except (KeyWrongLastSequenceError, KeyNotFoundError, Unavailable):
                raise
            except Exception as e:
                if is_wrong_sequence(e):
                    raise
                if not _leaderless(e):
                    raise Unavailable(
                        f"the state store (KV bucket {self.config.bucket}) failed to {what}: {type(e).__name__}: {e}"
                    ) from None
                fault = f"{type(e).__name__}: {e}"
            # a node lost: the stream elects a new leader (seconds) while the connection moves to a
            # survivor; retried within the patience. Past it, the stream has no quorum.
            if time.monotonic() > deadline:
                raise Unavailable(self.no_quorum(what, fault)) from None
            await anyio.sleep(0.25)  # back-off between retries, not a wait for a condition

    def no_quorum(self, what: str, fault: str) -> str:
        """Why a call could not `what` within the patience: the connection is down, the server
        does not answer (one replica), or the stream has no quorum."""
        if not self.nc.is_connected:
            return (
                f"the state store (KV bucket {self.config.bucket}) is unreachable: this controller's NATS connection "
                f"is down (reconnecting); could not {what} within {self.patience_s:g}s"
            )
        if self.config.replicas <= 1:
            return (
                f"the state store (KV bucket {self.config.bucket}) does not answer: could not {what} within "
                f"{self.patience_s:g}s ({fault}); its NATS server is down or overloaded"
            )
        return (
            f"the state store (KV bucket {self.config.bucket}, {self.config.replicas} replicas) has no quorum: "
            f"could not {what} within {self.patience_s:g}s ({fault}); a majority of its NATS nodes is down or "
            "cut off from this one. Nothing is committed until they return"
        )

    async def _bucket_exists(self) -> bool:
        try:
            await self.nc.jetstream(timeout=1.0).stream_info(f"KV_{self.config.bucket}")
        except NotFoundError:
            return False
        except Exception:
            return True
        return True

    async def _recover(self) -> None:
        log.error(
            "the state store (KV bucket %s) is gone; recreating it and writing back the controller's state",
            self.config.bucket,
        )
        self._recovering = True
        try:
            self.kv = await _open_bucket(self.nc, self.config)
            if self.on_lost is not None:
                await self.on_lost()
        finally:
            self._recovering = False

    async def get(self, key: str) -> tuple[bytes | None, int]:
        """A key's value and revision; (None, 0) when absent."""

        async def call() -> tuple[bytes | None, int]:
            try:
                e = await self.kv.get(key)
            except KeyNotFoundError:
                return None, 0
            return e.value, e.revision or 0

        return await self._guard(f"read {key}", call)

    def _issue(self, key: str) -> int:
        self._writes += 1
        self._latest[key] = self._writes
        return self._writes

    def _unless_superseded(self, key: str, value: bytes, issued: int) -> Callable[[], Awaitable[int]]:
        """A put of `value` (guarded), skipped (0) once a newer put to `key` than `issued` was issued."""

        async def attempt() -> int:
            if self._latest.get(key) != issued:
                log.info("put of %s not sent: a newer put to it was issued since", key)
                return 0
            return await self.kv.put(key, value)

        return lambda: self._guard(f"write {key}", attempt)

    async def put(self, key: str, value: bytes) -> int:
        self._issue(key)
        return await self._guard(f"write {key}", lambda: self.kv.put(key, value))

    async def put_ahead(self, key: str, value: bytes, *, issued: int | None = None) -> Callable[[], Awaitable[int]]:
        """A put sent now and acknowledged later. When this returns the write is on the
        connection, ahead of whatever this process sends after it (a reply): the server receives
        it first, so a process that dies after replying has not lost it. The call it returns
        waits for the store's acknowledgement; a first attempt that failed (no leader yet, the
        bucket recreated) is sent again, within the patience, unless a newer put to the same key
        was issued meanwhile (the next command's: sent again after it, this one would undo it;
        0 is returned then). `issued`: the put's number, taken earlier (`decision_later`): nothing is
        sent when a newer put was issued since."""
        if issued is None:
            issued = self._issue(key)
        elif self._latest.get(key) != issued:
            return self._unless_superseded(key, value, issued)  # superseded: sends nothing, returns 0
        try:
            # nats-py's KeyValue has no put that returns before its ack: its own subject and
            # JetStream context, as KeyValue.put uses them, with publish_async
            sent: asyncio.Future[PubAck] | None = await self.kv._js.publish_async(f"{self.kv._pre}{key}", value)
        except Exception as e:  # the connection is down: the put below says so
            log.debug("put of %s not sent ahead: %s", key, e)
            sent = None

        async def acked() -> int:
            nonlocal sent
            if sent is not None:
                try:
                    with anyio.fail_after(self.patience_s):
                        return (await sent).seq or 0
                except Exception as e:
                    sent.cancel()  # a future never answered is dropped from the client's table
                    sent = None  # awaited again (a record run again), it goes straight to the retry
                    log.debug("put of %s sent ahead failed (%s): sending it again", key, e)
            return await self._unless_superseded(key, value, issued)()

        return acked

    async def create(self, key: str, value: bytes) -> int:
        """Write a key that must not exist yet; KeyWrongLastSequenceError if it does."""

        async def attempt() -> int:
            try:
                return await self.kv.create(key, value)
            except KeyNotFoundError:
                # the server refused the create (wrong last sequence: the key is there), and
                # nats-py's read-back, which looks for a deleted key to write over, reached a
                # replica that has not applied it yet (a stream catching up after a node loss)
                raise KeyWrongLastSequenceError(description=f"{key} exists") from None

        return await self._guard(f"create {key}", attempt)

    async def update(self, key: str, value: bytes, last: int) -> int:
        return await self._guard(f"update {key}", lambda: self.kv.update(key, value, last=last))

    async def delete(self, key: str, last: int) -> None:
        await self._guard(f"delete {key}", lambda: self.kv.delete(key, last=last))

    async def take_epoch(self, above: int = 0) -> int:
        """Advance the epoch by one (and past `above`) with a revision check; two controllers
        never share one, and it never goes backwards."""
        while True:
            raw, rev = await self.get(KvKey.EPOCH)
            new = max(int(raw) if raw else 0, above) + 1
            try:
                if rev:
                    await self.update(KvKey.EPOCH, str(new).encode(), rev)
                else:
                    await self.create(KvKey.EPOCH, str(new).encode())
                return new
            except Exception as e:  # lost the race: read again
                if not is_wrong_sequence(e):
                    raise

    async def put_epoch(self, epoch: int) -> None:
        await self.put(KvKey.EPOCH, str(epoch).encode())

    async def version(self) -> VersionInfo:
        raw, _ = await self.get(KvKey.VERSION)
        return version_decoder.decode(raw) if raw else VersionInfo(version=DEFAULT_VERSION)

    async def put_version(self, info: VersionInfo) -> None:
        await self.put(KvKey.VERSION, encode(info))

    async def version_ahead(self, info: VersionInfo, *, unique: bool = False) -> Callable[[], Awaitable[None]]:
        """The version (and with `unique` its string's record) sent now, ahead of a reply; the
        call returned waits for the store to acknowledge both (see put_ahead)."""
        writes = [await self.put_ahead(KvKey.VERSION, encode(info))]
        if unique:
            writes.append(await self.put_ahead(_committed_key(info.version), str(info.seq).encode()))

        async def acked() -> None:
            for write in writes:
                await write()

        return acked

    def decision_later(self, decision: CommitDecision) -> Callable[[], Awaitable[Callable[[], Awaitable[int]]]]:
        """The decision, sent ahead (put_ahead) when the call returned is made: a put issued now,
        so a newer put to the key, issued before that call, wins (the call then sends nothing)."""
        key, value, issued = KvKey.DECISION, encode(decision), self._issue(KvKey.DECISION)
        return lambda: self.put_ahead(key, value, issued=issued)

    async def committed_seq(self, version: str) -> int | None:
        """The sequence a version string was committed with, if it ever was (unique_versions)."""
        raw, _ = await self.get(_committed_key(version))
        return int(raw) if raw else None

    async def desired(self) -> FleetState:
        raw, _ = await self.get(KvKey.DESIRED)
        return _desired.decode(raw) if raw else FleetState()

    async def put_desired(self, state: FleetState) -> None:
        await self.put(KvKey.DESIRED, encode(state))

    async def session(self) -> str | None:
        """The open session's id; None when none is open."""
        raw, _ = await self.get(KvKey.SESSION)
        if not raw:
            return None
        try:
            return _session.decode(raw)
        except msgspec.DecodeError:  # written as a bare id before the JSON record
            return raw.decode()

    async def _keep(self, key: str, value: bytes, ahead: bool, what: str) -> None:
        """A put; `ahead`: sent ahead of the command's reply and acknowledged after it
        (put_ahead, endpoints.after_reply), a refusal then logged naming `what`."""
        if ahead:
            await after_reply(await self.put_ahead(key, value), what)
        else:
            await self.put(key, value)

    async def put_session(self, session_id: str | None, *, ahead: bool = False) -> None:
        await self._keep(KvKey.SESSION, msgspec.json.encode(session_id), ahead, "the session's record")

    async def decision(self) -> CommitDecision | None:
        """The last decided commit, if any was ever decided."""
        raw, _ = await self.get(KvKey.DECISION)
        return _decision.decode(raw) if raw else None

    async def put_decision(self, decision: CommitDecision, *, ahead: bool = False) -> None:
        await self._keep(KvKey.DECISION, encode(decision), ahead, "the commit decision")

    async def push_lease(self) -> PushLease | None:
        raw, _ = await self.get(KvKey.PUSH_LEASE)
        return _push_lease.decode(raw) if raw else None

    async def put_push_lease(self, lease: PushLease | None, *, ahead: bool = False) -> None:
        record = encode(lease) if lease is not None else b"null"
        await self._keep(KvKey.PUSH_LEASE, record, ahead, "the push lease")


def default_replicas(nc: Client) -> int:
    """min(3, the number of servers in the cluster the connection is on): with 3 replicas the
    state survives one node lost, with 1 it lives on one node only."""
    return min(3, max(1, len(nc.servers)))


async def _open_bucket(nc: Client, config: KeyValueConfig, patience_s: float = OPEN_PATIENCE_S) -> KeyValue:
    """Open or create the bucket. While JetStream is still forming (a cluster electing its meta
    leader, a few seconds after start) the calls fail; they are retried for `patience_s`."""
    js = nc.jetstream()
    deadline = time.monotonic() + patience_s
    refused: BadRequestError | None = None
    """The server's last refusal of the create: right after a cluster elects its meta leader it
    may answer "no suitable peers for placement, peer offline" (a 400) for a while."""
    said = ""
    while True:
        try:
            try:
                return await js.key_value(config.bucket)
            except BucketNotFoundError:
                try:
                    return await js.create_key_value(config)
                except BadRequestError as e:
                    refused = e
                    return await js.key_value(config.bucket)  # created meanwhile by another controller
        except (ServiceUnavailableError, NatsTimeout, NoRespondersError, APIError) as e:
            why = refused if isinstance(e, BucketNotFoundError) and refused is not None else e
            if time.monotonic() > deadline or isinstance(e, BadRequestError):
                if why is e:
                    raise
                raise why from None  # the bucket is missing because the server refused to create it: say why
            if str(why) != said:  # each new answer once, not every quarter second
                said = str(why)
                log.warning("JetStream cannot open bucket %s yet (%s); retrying", config.bucket, why)
            await anyio.sleep(0.25)  # back-off between retries, not a wait for a condition


def _leaderless(e: Exception) -> bool:
    """A fault of a stream without a leader (or of a connection moving to another node): no
    answer in time, JetStream 503 (no meta leader), the connection reconnecting."""
    if isinstance(
        e, (NatsTimeout, TimeoutError, ServiceUnavailableError, ConnectionReconnectingError, StaleConnectionError)
    ):
        return True
    return isinstance(e, APIError) and e.code == 503


def _committed_key(version: str) -> str:
    return f"{KvKey.COMMITTED}.{hashlib.blake2b(version.encode(), digest_size=16).hexdigest()}"


def is_wrong_sequence(e: Exception) -> bool:
    return isinstance(e, KeyWrongLastSequenceError) or "wrong last sequence" in str(e).lower()


class ReplyStore:
    """Answers of state-changing commands by command id, in a KV bucket whose entries expire
    after `ttl_s`: a trainer that retries a command after a controller restart gets the first
    answer instead of running it twice.

    A command is claimed before it runs: one create of its id (a write the bucket's quorum
    takes, so a controller cut off from it runs nothing: UNAVAILABLE, as any state store call).
    The claim that finds the id taken reads what is there. The answer is sent to the store ahead
    of the reply on the same connection and acknowledged after it: the server has it before the
    caller can have the reply, so a controller that dies after replying has not lost it, and the
    reply waits for no round trip. A store that cannot take that write costs the durability of
    the answer, never the answer itself (the claim stays: a retry after a restart is refused,
    never run twice)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    @classmethod
    async def open(
        cls, nc: Client, bucket: str, ttl_s: float, replicas: int | None = None, patience_s: float = PATIENCE_S
    ) -> ReplyStore:
        config = KeyValueConfig(
            bucket=bucket,
            history=1,
            ttl=ttl_s,
            storage=StorageType.FILE,
            description="rlbus controller answers by command id",
            replicas=replicas or default_replicas(nc),
        )
        return cls(StateStore(nc, await _open_bucket(nc, config), config, patience_s))

    @staticmethod
    def _key(command_id: str) -> str:
        return hashlib.blake2b(command_id.encode(), digest_size=16).hexdigest()  # any id, a valid key

    async def claim(self, command_id: str, running: StoredReply) -> StoredReply | None:
        """Mark the command started (None), or what the id already holds: one round trip for a
        new id. Raises UNAVAILABLE when the store cannot take the write."""
        key = self._key(command_id)
        deadline = time.monotonic() + self.store.patience_s
        while True:
            try:
                await self.store.create(key, encode(running))
                return None
            except Exception as e:
                if not is_wrong_sequence(e):
                    raise
            raw, _ = await self.store.get(key)
            if raw:
                stored = _stored.decode(raw)
                if running.claim and stored.claim == running.claim:
                    return None  # our own claim: its write landed, its acknowledgement did not
                return stored
            # expired (or deleted) between the two calls, or read from a replica still catching
            # up: claim it again, within the store's patience
            if time.monotonic() > deadline:
                raise Unavailable(
                    self.store.no_quorum(f"claim {command_id}", "its record exists but no read returns it")
                )
            await anyio.sleep(0.05)  # back-off between retries, not a wait for a condition

    async def put(self, command_id: str, stored: StoredReply) -> Callable[[], Awaitable[None]]:
        """Keep an answer: sent when this returns, ahead of the reply; the call it returns waits
        for the store to acknowledge it (a write the store refuses is logged: the answer still
        goes out, and the claim stays, so a retry is refused rather than run twice)."""
        return logged(await self.store.put_ahead(self._key(command_id), encode(stored)), f"the answer to {command_id}")


_stored = msgspec.json.Decoder(StoredReply)
_session = msgspec.json.Decoder(str | None)
_decision = msgspec.json.Decoder(CommitDecision)
_push_lease = msgspec.json.Decoder(PushLease | None)
_desired = msgspec.json.Decoder(FleetState)
