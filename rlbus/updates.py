"""The trainer SDK's weight-update calls: the transfer group, sessions, pushes, versions.
A mixin of RLClient (client.py), which holds the connection and the request transport."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from rlbus.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    PermissionDenied,
    RLBusError,
    Unavailable,
)
from rlbus.schemas import (
    DEFAULT_VERSION,
    AbortWeightUpdate,
    Backend,
    FinishWeightUpdate,
    FleetAck,
    GetWeightVersion,
    InitWeightTransfer,
    PauseMode,
    ServerInfo,
    StartDraftWeightUpdate,
    StartWeightUpdate,
    TransferInit,
    UpdateWeights,
    UpdateWeightVersion,
    VersionInfo,
)

if TYPE_CHECKING:
    import torch
    from nats.aio.client import Client

    from rlbus.client import RLClient as _Base
else:
    _Base = object

log = logging.getLogger("rlbus.client")
T = TypeVar("T")

# Buckets sized to the transport: gloo pipelines best around 16 MiB; shm pays store round
# trips per bucket and copies straight out of the pool, so larger buckets win (bench/transfer.py,
# vs memcpy: 16 MiB 0.5-0.8x with one receiver; 64 MiB ~0.95x with one, 0.6-0.75x with two;
# 128 MiB 0.8-0.97x with one, 0.76-0.88x with two); nccl amortises its launches.
BUCKET_BYTES: dict[str, int] = {"gloo": 16 << 20, "shm": 128 << 20, "nccl": 256 << 20}

# watch_versions' JetStream API timeout: a request lost in a server restart is retried soon.
_WATCH_API_TIMEOUT_S = 2.0

# NATS' default max_payload is 1 MiB; metadata messages are split well below it.
_MAX_META_BYTES = 512 * 1024


class WeightUpdateCalls(_Base):
    @property
    def transfer_ready(self) -> bool:
        """True once init_weight_transfer() built a group that has not been torn down."""
        return self._tx is not None

    def _close_transfer(self) -> None:
        if self._tx is not None:
            self._tx.close()
        self._tx = self._init = None
        self._scratch, self._scratch_of = [], None

    async def init_weight_transfer(
        self, backend: Backend | None = None, *, master_addr: str | None = None, timeout_s: float = 60.0
    ) -> FleetAck:
        """Open the trainer's side of a transfer group (rank 0) while every worker joins it.

        backend: None = the backend every worker reports. master_addr: this host as workers
        reach it (default $RLBUS_MASTER_ADDR or 127.0.0.1). Collectives time out after timeout_s.
        """
        import os

        master_addr = master_addr or os.environ.get("RLBUS_MASTER_ADDR", "127.0.0.1")
        from rlbus.transfer.base import TransferError
        from rlbus.transfer.factory import trainer_transfer

        info = await self.server_info()
        fleet_backend = info.capabilities.weight_transfer_backend
        chosen = backend or fleet_backend
        backends = {w.worker_id: w.capabilities.weight_transfer_backend for w in info.workers}
        if not info.workers:
            raise Unavailable("no workers are registered")
        if chosen is None or any(b != chosen for b in backends.values()):
            # refuse here, before a rendezvous thread would wait for ranks that never come
            raise FailedPrecondition(f"workers have no common weight transfer backend {chosen or ''}: {backends}")
        if info.session_id:
            raise FailedPrecondition(f"session {info.session_id} is open; finish or abort it first")
        self._close_transfer()
        tx = trainer_transfer(chosen)
        init = tx.bind(
            TransferInit(
                backend=chosen, master_addr=master_addr, master_port=0, world_size=len(info.workers) + 1,
                rank_offset=1, group_name=f"rlbus-{uuid.uuid4().hex[:12]}", timeout_s=timeout_s,
            )
        )
        opened = anyio.Event()
        failure: list[BaseException] = []

        async def open_side() -> None:
            try:
                await anyio.to_thread.run_sync(tx.open, init, abandon_on_cancel=True)
            except BaseException as e:  # noqa: BLE001
                failure.append(e)
            opened.set()

        refused: list[RLBusError] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(open_side)
                try:
                    ack = await self._call(
                        InitWeightTransfer(backend=chosen, init_info=init), FleetAck, timeout=max(self.timeout, timeout_s + 10)
                    )
                except RLBusError as e:
                    refused.append(e)
                    tg.cancel_scope.cancel()  # the open side would only time out
                else:
                    await opened.wait()
        except BaseException:
            tx.close()
            raise
        if refused:
            tx.close()
            raise refused[0]
        if failure:
            tx.close()
            e = failure[0]
            if isinstance(e, TransferError):
                raise DeadlineExceeded(f"weight-transfer group did not form: {e}") from None
            raise e
        self._tx, self._init = tx, init
        self._group = [w.worker_id for w in ack.workers]
        return ack

    async def start_weight_update(self) -> FleetAck:
        """Open an update session for the main model on every worker."""
        ack = await self._call(StartWeightUpdate(target="main"), FleetAck)
        self._checksums = []
        return ack

    async def start_draft_weight_update(self) -> FleetAck:
        """Open an update session whose target is the draft (speculative decoding) model."""
        ack = await self._call(StartDraftWeightUpdate(), FleetAck)
        self._checksums = []
        return ack

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], *, bucket_bytes: int | None = None
    ) -> FleetAck:
        """Send tensors to every worker: metadata through the controller (every worker checks
        names, dtypes and shapes first), then the bytes out-of-band in checksummed buckets,
        each packed and hashed while the one before it is on the wire."""
        from rlbus.transfer.base import TransferError
        from rlbus.transfer.stream import prepare, scratch_bytes, send_stream

        tx = self._tx
        if tx is None:
            raise FailedPrecondition("no weight-transfer group; call init_weight_transfer() first")
        # GPU tensors stay where they are: each is copied to the host as its bucket is packed,
        # overlapping the wire, and the host never holds more than the two scratch buckets.
        named = [(n, t.detach()) for n, t in named_tensors]
        size = bucket_bytes or self.bucket_bytes or BUCKET_BYTES[self._init.backend if self._init else "gloo"]
        plan = prepare(named, size)
        # A transport that can share the trainer's memory (shm) hands out the scratch
        # buffers itself: every bucket is packed there and workers copy straight out of it.
        alloc = getattr(tx, "alloc", None)
        need = scratch_bytes(plan, named, pack_every_bucket=alloc is not None)
        if self._scratch_of is not tx or min((b.numel() for b in self._scratch), default=-1) < need:
            pair = alloc(2 * need) if alloc is not None else torch_empty_bytes(2 * need)
            self._scratch, self._scratch_of = [pair[:need], pair[need:]], tx  # reused every step
        ack: FleetAck | None = None
        for first, last in _chunks(plan.per_bucket):
            params = [msgspec.structs.replace(m, bucket=m.bucket - first) for k in range(first, last) for m in plan.per_bucket[k]]
            buckets = [msgspec.structs.replace(b, index=b.index - first) for b in plan.buckets[first:last]]
            ack = await self._call(UpdateWeights(params=params, buckets=buckets), FleetAck)
            try:
                self._checksums += await anyio.to_thread.run_sync(
                    lambda: send_stream(tx, plan, named, first=first, last=last, scratch=self._scratch,
                                        pack_every_bucket=alloc is not None),
                    abandon_on_cancel=True,
                )
            except TransferError as e:
                self._close_transfer()
                raise Aborted(f"sending weights failed ({e}); abort the session and init_weight_transfer() again") from None
        if ack is None:  # nothing to send: still tell the controller (an empty update)
            ack = await self._call(UpdateWeights(params=[], buckets=[]), FleetAck)
        return ack

    async def finish_weight_update(self, weight_version: str | None = None) -> FleetAck:
        """Commit on every worker (two-phase) and publish the version; None keeps the version string.

        Carries the checksum of every bucket this client sent in the session, which each
        worker verifies before it reports ready: finish from the client that sent the bytes."""
        return await self._call(FinishWeightUpdate(weight_version=weight_version, checksums=self._checksums), FleetAck)

    async def abort_weight_update(self, reason: str = "") -> FleetAck:
        """Drop the open session everywhere; old weights and version stay."""
        ack = await self._call(AbortWeightUpdate(reason=reason), FleetAck)
        self._checksums = []
        return ack

    async def update_weight_version(self, new_version: str) -> FleetAck:
        """Set the version string without a transfer (refused while a session is open)."""
        return await self._call(UpdateWeightVersion(new_version=new_version), FleetAck)

    async def get_weight_version(self) -> str:
        """The version every worker holds; an error naming who disagrees otherwise."""
        return (await self._call(GetWeightVersion(), VersionInfo)).version

    async def watch_versions(self) -> AsyncIterator[VersionInfo]:
        """Yield the committed version first, then each new one. Backed by JetStream KV, so
        a subscriber that was disconnected, even while it was still subscribing, still ends
        on the current version."""
        import nats.js.errors
        from nats.js.api import DeliverPolicy

        js = self.nc.jetstream(timeout=_WATCH_API_TIMEOUT_S)
        try:
            kv = await _retry_transient(self.nc, lambda: js.key_value(self.subjects.kv_bucket))
        except nats.js.errors.BucketNotFoundError:
            raise Unavailable("no controller has run on this prefix yet (no state bucket)") from None
        # Subscribe before reading the current value, so no commit falls between the two.
        # An ordered consumer with a 1 s idle heartbeat notices a lost server within seconds
        # and resumes after the last sequence it delivered.
        sub = await _retry_transient(self.nc, lambda: js.subscribe(
            f"$KV.{self.subjects.kv_bucket}.version", stream=f"KV_{self.subjects.kv_bucket}",
            ordered_consumer=True, idle_heartbeat=1.0,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ))
        try:
            decoder = msgspec.json.Decoder(VersionInfo)
            try:
                entry = await _retry_transient(self.nc, lambda: kv.get("version"))
                seen, current = entry.revision or 0, decoder.decode(entry.value)
            except nats.js.errors.KeyNotFoundError:
                seen, current = 0, VersionInfo(version=DEFAULT_VERSION)
            yield current
            async for msg in sub.messages:
                if msg.metadata.sequence.stream <= seen or not msg.data:
                    continue
                seen = msg.metadata.sequence.stream
                yield decoder.decode(msg.data)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await sub.unsubscribe()
                except Exception:  # the connection is already closing
                    pass

    async def push_weights(
        self,
        named_tensors: Iterable[tuple[str, "torch.Tensor"]],
        version: str | None = None,
        *,
        pause_mode: PauseMode = "wait",
        draft: bool = False,
        bucket_bytes: int | None = None,
    ) -> FleetAck:
        """pause -> start -> update -> finish -> resume. Any failure aborts the session
        everywhere (old weights and version stay) and re-raises; the fleet is resumed."""
        paused = await self.pause(pause_mode)
        try:
            fleet = [w.worker_id for w in paused.workers]
            if self._tx is None or fleet != self._group or not all(w.transfer_ready for w in paused.workers):
                await self.init_weight_transfer()  # no group yet, or the fleet changed since
            if draft:
                await self.start_draft_weight_update()
            else:
                await self.start_weight_update()
            try:
                await self.update_weights(named_tensors, bucket_bytes=bucket_bytes)
                return await self.finish_weight_update(version)
            except BaseException as e:
                with anyio.CancelScope(shield=True):
                    try:
                        await self.abort_weight_update(reason=f"push failed: {e}")
                    except RLBusError as abort_error:
                        log.warning("abort after a failed push also failed: %s", abort_error)
                    info = await self._safe_server_info()
                    if info is not None and not all(w.state.transfer_ready for w in info.workers):
                        self._close_transfer()  # a worker left the group: rebuild it next time
                raise
        finally:
            with anyio.CancelScope(shield=True):
                await self.resume()

    async def _safe_server_info(self) -> ServerInfo | None:
        try:
            return await self.server_info()
        except RLBusError:
            return None


def _chunks(per_bucket: list[list[Any]]) -> Iterator[tuple[int, int]]:
    """Consecutive bucket ranges whose metadata stays under the message size limit."""
    first, size = 0, 0
    for k, metas in enumerate(per_bucket):
        cost = 200 + sum(120 + len(m.name) + 12 * len(m.shape) for m in metas)
        if k > first and size + cost > _MAX_META_BYTES:
            yield first, k
            first, size = k, 0
        size += cost
    if per_bucket:
        yield first, len(per_bucket)


def torch_empty_bytes(n: int) -> "torch.Tensor":
    import torch

    return torch.empty(n, dtype=torch.uint8)



async def _retry_transient(nc: "Client", call: Callable[[], Awaitable[T]]) -> T:
    """Run a JetStream API call, retrying while the server is away (a restart, a reconnect):
    a long-lived watcher must outlive those. Gives up when the connection is closed, and at
    once when the server denied the call (a denial looks like a timeout to nats-py)."""
    import nats.errors
    import nats.js.errors

    from rlbus.connection import denials_of

    denials = denials_of(nc)
    delay = 0.05
    while True:
        before = len(denials.seen)
        try:
            return await call()
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError,
                nats.errors.ConnectionReconnectingError) as e:
            denied = [s for _, s in denials.seen[before:] if s.startswith("$js.")]
            if denied:
                raise PermissionDenied(f"the NATS server denies this identity the JetStream API {denied[0]}; "
                                       "check its credentials and role") from None
            if nc.is_closed:
                raise Unavailable(f"the NATS connection is closed ({e!r})") from e
            log.info("JetStream call failed while the server is away (%r); retrying", e)
            await anyio.sleep(delay)  # back-off between retries, not a wait for a condition
            delay = min(delay * 2, 1.0)
