"""The controller service: trainer commands in, fleet-wide fan-out, answers back.

Every state-changing operation takes `self._lock`; reads (is_paused, is_sleeping,
server_info, get_weight_version) never wait on it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import anyio
import msgspec
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.service import Service

from rlbus.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlbus.schemas import (
    AnyCommand,
    Capabilities,
    WorkerState,
    Sync,
    ControllerHello,
    EventKind,
    FleetAck,
    FleetEvent,
    GetStatus,
    Heartbeat,
    Pause,
    Resume,
    ServerInfo,
    Sleep,
    Subjects,
    VersionInfo,
    WakeUp,
    WorkerGone,
    WorkerReady,
    encode,
    event_decoder,
)
from rlbus.schemas.codec import DecodeError
from rlbus.services.handlers import Endpoints

from . import session as S
from .fanout import Outcome, fan_out
from .leadership import Lease, LeaseLost
from .registry import Registry
from .store import StateStore
from .weights import WeightUpdateHandlers

log = logging.getLogger("rlbus.controller")

SERVICE_VERSION = "0.1.0"


class ControllerOptions(msgspec.Struct, frozen=True, kw_only=True):
    subjects: Subjects = Subjects()
    command_timeout_s: float = 30.0
    """Deadline of one fan-out (every worker must answer within it)."""
    liveness_timeout_s: float = 3.0
    """A worker silent this long leaves the registry."""
    drain_timeout_s: float = 10.0
    lease_s: float = 5.0
    """Leadership lease: a standby controller takes over this long after the leader's last renewal."""


class ControllerService(WeightUpdateHandlers):
    def __init__(self, nc: Client, options: ControllerOptions | None = None) -> None:
        self.nc = nc
        self.opts = options or ControllerOptions()
        self.subjects = self.opts.subjects
        self.registry = Registry(self.opts.liveness_timeout_s)
        self.id = uuid.uuid4().hex[:12]
        self.epoch = 0
        self.store: StateStore | None = None
        self.version = VersionInfo(version="default")
        self.session: S.SessionState = S.Idle()
        self._kv_session: str | None = None  # the open session KV records (weights.py)
        self._lock = anyio.Lock()
        self._stop = anyio.Event()
        self._micro: Service | None = None
        self._changed = anyio.Event()
        self._last_hello = 0.0
        self._tg: anyio.abc.TaskGroup = _NoTaskGroup()  # type: ignore[assignment]
        self.standby_for: str | None = None
        """While waiting for the lease: the controller that holds it."""
        self.lease_lost = False

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:  # noqa: ANN001
        self.store = await StateStore.open(self.nc, self.subjects.kv_bucket)
        lease = Lease(self.store.kv, self.id, self.opts.lease_s)
        async with anyio.create_task_group() as wait:  # standby until the lease is ours, or stop()

            async def stop_waiting() -> None:
                await self._stop.wait()
                wait.cancel_scope.cancel()

            wait.start_soon(stop_waiting)
            await lease.acquire(lambda holder: setattr(self, "standby_for", holder.controller_id))
            wait.cancel_scope.cancel()
        if self._stop.is_set():
            return
        self.standby_for = None
        self.epoch = await self.store.take_epoch()
        self.version = await self.store.version()
        orphan = await self.store.session()
        if orphan:  # a session a previous controller left open: it will be aborted on every worker
            log.warning("session %s was open when the last controller stopped; aborting it", orphan)
            await self.store.put_session(None)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            eps = Endpoints(tg, "controller")
            self._micro = await add_service(
                self.nc,
                name="rlbus-controller",
                version=SERVICE_VERSION,
                description="rlbus fleet controller",
                metadata={"controller_id": self.id, "epoch": str(self.epoch)},
            )
            group = self._micro.add_group(name=f"{self.subjects.prefix}.control")
            handlers = self._handlers()
            for op, handler in handlers.items():
                # server_info reads memory only: answered inside the callback
                await group.add_endpoint(name=op, subject=op, handler=eps.command(op, handler, inline=op == "server_info"))
            await group.add_endpoint(name="unknown", subject="*", queue_group="rlbus-unknown", handler=eps.unknown(set(handlers)))
            subs = [
                await self.nc.subscribe(self.subjects.worker_ready, cb=self._on_worker_event),
                await self.nc.subscribe(self.subjects.worker_heartbeat, cb=self._on_worker_event),
                await self.nc.subscribe(self.subjects.worker_gone, cb=self._on_worker_event),
            ]
            await self.nc.flush()
            await self._hello()
            tg.start_soon(self._sweep)
            tg.start_soon(self._keep_lease, lease)
            log.info("controller %s up, epoch %d, version %s", self.id, self.epoch, self.version.version)
            task_status.started()
            await self._stop.wait()
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(2):  # unsubscribing needs a live connection
                    for sub in subs:
                        await sub.unsubscribe()
                    await self._micro.stop()
                with anyio.move_on_after(self.opts.drain_timeout_s):
                    await eps.wait_idle()
                if not self.lease_lost:
                    with anyio.move_on_after(2):
                        await lease.release()  # a standby takes over at once
            tg.cancel_scope.cancel()

    async def _keep_lease(self, lease: Lease) -> None:
        try:
            await lease.keep()
        except LeaseLost as e:
            log.error("controller %s lost leadership (%s); stepping down", self.id, e)
            self.lease_lost = True
            self.stop()

    def stop(self) -> None:
        self._stop.set()

    async def _hello(self) -> None:
        self._last_hello = time.monotonic()
        await self.nc.publish(self.subjects.controller_hello, encode(ControllerHello(epoch=self.epoch, controller_id=self.id)))

    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(min(0.5, self.opts.liveness_timeout_s / 3))
            for w in self.registry.expired():
                await self._drop(w, "missed heartbeats")

    async def _drop(self, worker_id: str, why: str) -> None:
        if self.registry.leave(worker_id):
            log.warning("worker %s left the registry: %s", worker_id, why)
            self._notify()
            await self._event("worker_left", [worker_id], why)
            if not isinstance(self.session, S.Idle):
                self._tg.start_soon(self._abort_on_loss, worker_id)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, predicate: Callable[[Registry], bool]) -> None:
        """Return once `predicate(registry)` holds (checked on every registry change)."""
        while not predicate(self.registry):
            await self._changed.wait()

    async def _event(self, kind: EventKind, workers: list[str], detail: str = "", session_id: str | None = None) -> None:
        ev = FleetEvent(event=kind, epoch=self.epoch, workers=workers, detail=detail, session_id=session_id, time=time.time())
        try:
            await self.nc.publish(self.subjects.event(kind), encode(ev))
        except Exception as e:  # events are best effort; state lives in KV and replies
            log.debug("event %s not published: %s", kind, e)

    async def _on_worker_event(self, msg) -> None:  # noqa: ANN001
        try:
            ev = event_decoder.decode(msg.data)
        except DecodeError:
            log.warning("undecodable worker event on %s", msg.subject)
            return
        match ev:
            case WorkerReady(capabilities=caps, state=state):
                self._tg.start_soon(self._admit, caps, state)
            case Heartbeat(state=state):
                if not self.registry.seen(state) and time.monotonic() - self._last_hello > 1.0:
                    await self._hello()  # an unknown worker: ask everyone to re-announce
            case WorkerGone(worker_id=w, reason=why):
                await self._drop(w, why or "stopped")

    async def _admit(self, caps: Capabilities, state: WorkerState) -> None:
        """Register an announced worker once it knows the committed version (an older one
        goes stale and takes no generation traffic), and drop any session it holds that
        this controller does not (an orphan from before a restart)."""
        w = state.worker_id
        out = await fan_out(
            self.nc, self.subjects, [w], Sync(epoch=self.epoch, command_id=uuid.uuid4().hex, committed_version=self.version.version),
            min(5.0, self.opts.command_timeout_s),
        )
        synced = out.acks.get(w)
        if synced is None:
            log.warning("worker %s announced itself but did not take the sync: %s", w, out.failures)
            return
        if self.registry.join(caps, synced):
            log.info("worker %s joined (%s)", w, caps.model_name)
            self._notify()
            await self._event("worker_joined", [w])
        if synced.stale:
            await self._event(
                "worker_stale", [w],
                f"holds {synced.weight_version}, committed is {self.version.version}; push weights to bring it in step",
            )
        if synced.session_id and synced.session_id != self._session_id():
            await self._abort_orphan(w, synced.session_id)

    # ---- fan-out -----------------------------------------------------------------------

    def _workers(self) -> list[str]:
        ids = self.registry.ids()
        if not ids:
            raise Unavailable("no workers are registered; start workers (rlbus worker) and retry")
        return ids

    async def _fan_out(self, command: AnyCommand | Callable[[str], AnyCommand], workers: list[str] | None = None, timeout: float | None = None) -> Outcome:
        workers = self._workers() if workers is None else workers
        command_id = uuid.uuid4().hex

        def stamp(c: AnyCommand) -> AnyCommand:
            # one fresh id per fan-out: the trainer's id dedups at the controller, this one at workers
            return msgspec.structs.replace(c, epoch=self.epoch, command_id=command_id)

        stamped = (lambda w: stamp(command(w))) if callable(command) else stamp(command)
        out = await fan_out(self.nc, self.subjects, workers, stamped, timeout or self.opts.command_timeout_s)
        for state in out.acks.values():
            self.registry.seen(state)
        for f in out.failures:
            if f.code == "UNAVAILABLE":
                await self._drop(f.worker_id, f.message)
        return out

    def _fleet(self, out: Outcome) -> FleetAck:
        return FleetAck(
            workers=[out.acks[w] for w in sorted(out.acks)],
            session_id=getattr(self.session, "session_id", None),
            weight_version=self.version.version,
            epoch=self.epoch,
        )

    async def _all(self, command: AnyCommand, what: str) -> FleetAck:
        out = await self._fan_out(command)
        out.raise_for_failures(what)
        return self._fleet(out)

    # ---- handlers ----------------------------------------------------------------------

    def _handlers(self) -> dict[str, Callable[[AnyCommand], Awaitable[object]]]:
        return {
            "pause": self._pause,
            "resume": self._resume,
            "is_paused": self._status,
            "sleep": self._sleep,
            "wake_up": self._wake_up,
            "is_sleeping": self._status,
            "server_info": self._server_info,
            "init_weight_transfer": self._init_weight_transfer,
            "start_weight_update": self._start_weight_update,
            "start_draft_weight_update": self._start_weight_update,
            "update_weights": self._update_weights,
            "finish_weight_update": self._finish_weight_update,
            "abort_weight_update": self._abort_weight_update,
            "update_weight_version": self._update_weight_version,
            "get_weight_version": self._get_weight_version,
        }

    async def _pause(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, Pause)
        async with self._lock:
            ack = await self._all(cmd, f"pause(mode={cmd.mode})")
        await self._event("paused", [w.worker_id for w in ack.workers], cmd.mode)
        return ack

    async def _resume(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, Resume)
        async with self._lock:
            ack = await self._all(cmd, "resume")
        await self._event("resumed", [w.worker_id for w in ack.workers])
        return ack

    async def _sleep(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, Sleep)
        if cmd.level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2, not {cmd.level}")
        async with self._lock:
            workers = self._workers()
            no_sleep = [w for w in workers if not self.registry.get(w).capabilities.sleep_mode_enabled]  # type: ignore[union-attr]
            if no_sleep:
                raise FailedPrecondition(
                    f"workers {no_sleep} were started without sleep mode; restart them with --enable-sleep-mode"
                )
            # refuse before anything changes: a worker with requests in flight cannot sleep
            status = await self._fan_out(GetStatus(), workers)
            status.raise_for_failures("sleep (status check)")
            busy = {w: st.in_flight for w, st in status.acks.items() if st.in_flight}
            if busy:
                raise FailedPrecondition(
                    f"requests are in flight on {busy}; pause with mode='abort' or 'wait' before sleeping"
                )
            out = await self._fan_out(cmd, workers)
            if not out.ok and out.acks and cmd.level == 1:
                # all or nothing: wake the workers that did fall asleep
                await self._fan_out(WakeUp(tags=cmd.tags), list(out.acks))
            out.raise_for_failures(f"sleep(level={cmd.level})")
            if cmd.tags is None or "weights" in cmd.tags:
                self._advance(S.SleepWeights())
                await self._set_session(S.Idle())
            ack = self._fleet(out)
        await self._event("sleeping", [w.worker_id for w in ack.workers], f"level {cmd.level}")
        return ack

    async def _wake_up(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, WakeUp)
        async with self._lock:
            ack = await self._all(cmd, "wake_up")
        await self._event("awake", [w.worker_id for w in ack.workers], ",".join(cmd.tags or ["all"]))
        return ack

    async def _status(self, cmd: AnyCommand) -> FleetAck:
        return await self._all(GetStatus(command_id=cmd.command_id), "status")

    async def _server_info(self, cmd: AnyCommand) -> ServerInfo:
        return ServerInfo(
            workers=self.registry.infos(self.version.version),
            capabilities=self.registry.aggregate(),
            epoch=self.epoch,
            weight_version=self.version.version,
            draft_version=self.version.draft_version,
            session_id=getattr(self.session, "session_id", None),
            controller_id=self.id,
        )


class _NoTaskGroup:
    """Before run(): nothing may be spawned yet."""

    def start_soon(self, *a: object, **k: object) -> None:
        raise RuntimeError("controller is not running")
