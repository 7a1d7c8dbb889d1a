"""The controller service: trainer commands in, fleet-wide fan-out, answers back.

Composed of the Fleet (fleet.py: registry, epoch, lock, stamped fan-out, events) and the
update sessions (updates.py). This module holds the lifecycle (leadership, subscriptions,
drain), worker admission, and the pause/sleep handlers. Every state-changing operation
takes the fleet's lock; reads (is_paused, is_sleeping, server_info, get_weight_version)
never wait on it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.service import Service
from rlbus.schemas import (
    DEFAULT_VERSION,
    SLEEP_TAGS,
    UNKNOWN_OP_QUEUE,
    Capabilities,
    ControllerHello,
    FleetAck,
    FleetState,
    GetServerInfo,
    Heartbeat,
    IsPaused,
    IsSleeping,
    Pause,
    PauseWorker,
    Resume,
    ResumeWorker,
    ServerInfo,
    ServiceName,
    Sleep,
    SleepWorker,
    StatusWorker,
    Subjects,
    SyncWorker,
    Unavailable,
    UpdateWeights,
    VerifyWeights,
    VersionInfo,
    WakeUp,
    WakeUpWorker,
    WorkerGone,
    WorkerReady,
    WorkerState,
    encode,
    event_decoder,
    op_of,
    refuse,
)
from rlbus.schemas.codec import DecodeError
from rlbus.services.endpoints import ClaimOutcome, Endpoints, Gate, NotRunning, Route, Routes, claimed
from rlbus.services.metrics import ControllerMetrics, MetricsServer

from rlbus.bus.connection import stop_service

from . import session as S
from .fanout import Outcome
from .fleet import Fleet, alongside, stamped
from .leadership import Lease, LeaseLost
from .pushlease import PUSH_LEASE_S
from .registry import Registry
from .repair import RepairOptions, Repairs
from .store import ReplyStore, StateStore
from .updates import Updates
from .verify import verify_weights

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
    unique_versions: bool = False
    """Refuse a version string that was committed before (versions stay free-form otherwise)."""
    state_replicas: int | None = None
    """Replicas of the state buckets on a NATS cluster; None = min(3, cluster size)."""
    state_patience_s: float = 15.0
    """How long a state store call rides out a stream without a leader (a NATS node lost: a new
    one is elected in seconds) before it is UNAVAILABLE: the store has no quorum."""
    reply_ttl_s: float = 600.0
    """How long answers of state-changing commands are kept by command id (in KV, across restarts)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port at /metrics (0: any free port; None: no endpoint)."""
    repair: RepairOptions = RepairOptions()
    """Workers behind the committed weights are repaired from a healthy peer (repair.py)."""
    push_lease_s: float = PUSH_LEASE_S
    """The push lease (one trainer at a time updates weights) lapses this long after its holder's
    last command: a dead trainer blocks other trainers' pushes at most this long."""


class ControllerService:
    def __init__(self, nc: Client, options: ControllerOptions | None = None) -> None:
        self.nc = nc
        self.opts = options or ControllerOptions()
        self.subjects = self.opts.subjects
        self.id = uuid.uuid4().hex[:12]
        self.fleet = Fleet(nc, self.subjects, Registry(self.opts.liveness_timeout_s), self.opts.command_timeout_s)
        self.fleet.on_lost = self._drop
        self.updates: Updates = _NotLeading()  # type: ignore[assignment]
        """The update sessions; built once this controller leads (they need the state store)."""
        self.repairs: Repairs = _NotLeading()  # type: ignore[assignment]
        """Repairs of workers behind the committed weights; built once this controller leads."""
        self._stop = anyio.Event()
        self._micro: Service | None = None
        self._changed = anyio.Event()
        self._last_hello = 0.0
        self._tg: anyio.abc.TaskGroup = NotRunning()  # type: ignore[assignment]
        self.desired = FleetState()
        """What the trainer asked the fleet to be (kept in KV): every admitted worker is brought to it."""
        self._kv_desired: FleetState | None = None
        """The desired state as KV holds it (None: not read yet)."""
        self.standby_for: str | None = None
        """While waiting for the lease: the controller that holds it."""
        self.lease_lost = False
        self.metrics = ControllerMetrics()
        self.metrics.watch(self)
        self.fleet.metrics = self.metrics
        self.metrics_server: MetricsServer | None = None
        """Serving /metrics (when options.metrics_port is set); its `port` is the bound one."""
        self._dropping_lease = False
        self._recording_again = False
        """A run of the last commit's failed record is under way (`_record_again`)."""

    @property
    def registry(self) -> Registry:
        return self.fleet.registry

    @property
    def epoch(self) -> int:
        return self.fleet.epoch

    @property
    def version(self) -> VersionInfo:
        """The committed version."""
        return self.updates.version

    @property
    def store(self) -> StateStore:
        return self.updates.store

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        if self.opts.metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics.registry, self.opts.metrics_port)
        try:
            await self._run(task_status)
        finally:
            if self.metrics_server is not None:
                self.metrics_server.close()

    async def _run(self, task_status) -> None:
        store = await StateStore.open(
            self.nc, self.subjects.kv_bucket, self.opts.state_replicas, self.opts.state_patience_s
        )
        lease = self._lease = Lease(store, self.id, self.opts.lease_s)
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
        self.fleet.epoch = await store.take_epoch()
        version = await store.version()
        if version.epoch == 0 and version.seq == 0 and version.version == DEFAULT_VERSION:
            # nothing committed yet: record "default" at this epoch, so the KV key exists from the
            # start and every reply names one coherent epoch
            version = msgspec.structs.replace(version, epoch=self.fleet.epoch, time=time.time())
            await store.put_version(version)
        self.updates = Updates(
            self.fleet, store, version, unique_versions=self.opts.unique_versions, push_lease_s=self.opts.push_lease_s
        )
        self.updates.withhold = self._resync
        self.repairs = Repairs(self.fleet, self.updates, self.opts.repair)
        await self.updates.leases.load()
        self.desired = self._kv_desired = await store.desired()

        async def write_back() -> None:  # the bucket vanished under a running leader: it knows everything
            await store.put_epoch(self.fleet.epoch)
            await store.put_version(self.updates.version)
            await store.put_desired(self.desired)
            self._kv_desired = self.desired
            await store.put_session(self.updates.session_id)
            await lease.reclaim()
            await self.fleet.event(
                "state_lost",
                self.registry.ids(),
                f"the state bucket was lost and recreated; epoch {self.fleet.epoch} and version "
                f"{self.updates.version.version} written back from the running controller",
            )

        store.on_lost = write_back
        orphan = await store.session()
        # a commit the last controller decided is finished (never aborted): recorded, published once
        await self.updates.take_over(await store.decision(), orphan)
        orphan = await store.session()
        if orphan:  # a session a previous controller left open: it will be aborted on every worker
            log.warning("session %s was open when the last controller stopped; aborting it", orphan)
            await store.put_session(None)
            self.updates.aborted(
                orphan, f"it was open when the controller running it stopped; controller {self.id} took over"
            )
        replies = await ReplyStore.open(
            self.nc,
            self.subjects.replies_bucket,
            self.opts.reply_ttl_s,
            self.opts.state_replicas,
            self.opts.state_patience_s,
        )
        async with anyio.create_task_group() as tg:
            self._tg = tg
            eps = Endpoints(tg, "controller", durable=replies)
            self._micro = await add_service(
                self.nc,
                name=ServiceName.CONTROLLER,
                version=SERVICE_VERSION,
                description="rlbus fleet controller",
                metadata={"controller_id": self.id, "epoch": str(self.epoch)},
            )
            # a queue group of this controller's own: a leader frozen or cut off behind a server
            # that has not noticed yet (default pings: minutes) keeps its subscription, and in a
            # shared group it would take every other call; here each call reaches the new leader too
            group = self._micro.add_group(name=self.subjects.control_group, queue_group=f"rlbus-controller-{self.id}")
            routes = self._routes()
            await eps.serve(group, routes, wrap=self._measured, gate=self._leading(lease))
            subs = [
                await self.nc.subscribe(
                    f"{self.subjects.control_group}.*",
                    queue=UNKNOWN_OP_QUEUE,
                    cb=Endpoints.unknown(self.nc, routes.ops()),
                ),
                *[
                    await self.nc.subscribe(self.subjects.worker_events(kind), cb=self._on_worker_event)  # type: ignore[arg-type]
                    for kind in ("ready", "heartbeat", "gone")
                ],
            ]
            await self.nc.flush()
            await self._hello()
            tg.start_soon(self._sweep)
            tg.start_soon(self._keep_lease, lease)
            tg.start_soon(self.repairs.run)
            log.info("controller %s up, epoch %d, version %s", self.id, self.epoch, self.version.version)
            task_status.started()
            await self._stop.wait()
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(2):  # unsubscribing needs a live connection
                    for sub in subs:
                        await sub.unsubscribe()
                    await stop_service(self._micro)
                with anyio.move_on_after(self.opts.drain_timeout_s):
                    await eps.wait_idle()
                if not self.lease_lost:
                    with anyio.move_on_after(2):
                        await lease.release()  # a standby takes over at once
            tg.cancel_scope.cancel()

    def _leading(self, lease: Lease) -> Gate:
        """Before every command, and before its id is answered or claimed by the reply cache
        (endpoints.Gate; the sends of one command that wait behind it share its refusal). A state-changing
        command confirms the lease: a command with an id is claimed in the answer store next (a
        quorum write before anything is dispatched, endpoints.ReplyCache), so a lease its expiry
        proves needs no round trip; one without an id renews it (a compare-and-set in the state
        store). A read goes through while the last renewal proves the lease, else renews too.
        Without quorum (nodes down, a partition) the command is UNAVAILABLE before anything is
        dispatched; with the lease taken, this controller steps down. A leader that wakes from a
        freeze, or one cut off, never answers with state a successor has moved on from, and
        never records a refusal under an id its successor answers."""

        async def gate(route: Route[Any], cmd: Any) -> None:
            if not route.read or not lease.fresh():
                try:
                    await lease.confirm(quorum_proven=bool(cmd.command_id) and not route.read)
                except LeaseLost as e:
                    self._step_down(e)
                    raise Unavailable(
                        f"controller {self.id} no longer leads ({e}); the leader answers a retry"
                    ) from None
            self.updates.leases.touch(cmd.trainer_id)  # any command of the push lease's holder renews it

        return gate

    def _measured(self, handler):
        """Around every handler: its answer time, and the weight bytes an update announced."""

        async def measured(cmd):
            began = time.monotonic()
            ok = False
            try:
                result = await handler(cmd)
                ok = True
                if isinstance(cmd, UpdateWeights):
                    self.metrics.sent(cmd.params)
                return result
            finally:
                self.metrics.answered(op_of(cmd), time.monotonic() - began, ok)

        return measured

    # what the metrics read at scrape time (services/metrics.py: ControllerView)

    def metrics_version(self) -> VersionInfo:
        return (
            self.updates.version if not isinstance(self.updates, _NotLeading) else VersionInfo(version=DEFAULT_VERSION)
        )

    def metrics_workers(self) -> list[WorkerState]:
        return [self.registry.state(w) for w in self.registry.ids()]

    def metrics_leading(self) -> bool:
        return not isinstance(self.updates, _NotLeading) and not self.lease_lost

    def metrics_paused_since(self) -> float | None:
        return self.desired.paused_since if self.desired.paused else None

    def _step_down(self, why: Exception) -> None:
        if not self.lease_lost:
            log.error("controller %s lost leadership (%s); stepping down", self.id, why)
        self.lease_lost = True
        self.stop()

    async def _keep_lease(self, lease: Lease) -> None:
        try:
            await lease.keep()
        except LeaseLost as e:
            self._step_down(e)

    def stop(self) -> None:
        self._stop.set()

    async def _hello(self) -> None:
        self._last_hello = time.monotonic()
        await self.nc.publish(
            self.subjects.controller_hello, encode(ControllerHello(epoch=self.epoch, controller_id=self.id))
        )

    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(min(0.5, self.opts.liveness_timeout_s / 3))
            for w in self.registry.expired():
                await self._drop(w, "missed heartbeats")
            if self.updates.leases.lapsed() is not None and not self._dropping_lease:
                self._dropping_lease = True
                self._tg.start_soon(self._drop_lapsed_lease)
            if self.updates.unrecorded and not self._recording_again:
                self._recording_again = True
                self._tg.start_soon(self._record_again)

    async def _record_again(self) -> None:
        """The last commit was answered but the store refused its record for a whole patience:
        run it again (its version's write, its rl.version event, its decision marked done), so
        subscribers hear of the commit once the store takes writes, not at the next commit."""
        try:
            await self.updates.record_again()
            log.info("the last commit's record was kept in the state store and its version said")
        except Exception as e:
            log.warning("the last commit's record is still not kept in the state store: %s", e)
        finally:
            self._recording_again = False

    async def _drop_lapsed_lease(self) -> None:
        try:
            await self.updates.drop_lapsed_lease()
        except Exception as e:
            log.warning("could not release a lapsed push lease: %s", e)
        finally:
            self._dropping_lease = False

    async def _drop(self, worker_id: str, why: str) -> None:
        if self.registry.leave(worker_id):
            log.warning("worker %s left the registry: %s", worker_id, why)
            self._notify()
            await self.fleet.event("worker_left", [worker_id], why)
            if not isinstance(self.updates.session, S.Idle):
                self._tg.start_soon(self.updates.abort_on_loss, worker_id)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, predicate: Callable[[Registry], bool]) -> None:
        """Return once `predicate(registry)` holds (checked on every registry change)."""
        while not predicate(self.registry):
            await self._changed.wait()

    async def _on_worker_event(self, msg) -> None:
        try:
            ev = event_decoder.decode(msg.data)
        except DecodeError:
            log.warning("undecodable worker event on %s", msg.subject)
            return
        sender = Subjects.worker_of_event(msg.subject)
        claimed = ev.state.worker_id if isinstance(ev, (WorkerReady, Heartbeat)) else getattr(ev, "worker_id", None)
        if claimed != sender or (isinstance(ev, (WorkerReady, Heartbeat)) and ev.worker_id != sender):
            # each worker publishes only under its own id (scoped credentials): a mismatch is forged
            log.warning("ignored a %s on %s claiming to be from worker %s", type(ev).__name__, msg.subject, claimed)
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
        """Register an announced worker once it holds the desired state: it pauses, sleeps,
        resumes or wakes to match the fleet, and takes no generation traffic while it is
        behind the committed version (SyncWorker). Under the fleet's lock, so no pause or sleep
        falls between its sync and its joining. Then drop any session it holds that this
        controller does not (an orphan from before a restart)."""
        w = state.worker_id
        async with self.fleet.lock:
            if state.epoch > self.fleet.epoch or (
                state.epoch == self.fleet.epoch and state.controller_id not in ("", self.id)
            ):
                if not await self._still_leading(state):
                    return
                await self._recover_lost_state(state)
            if self.updates.finish_for(state):  # it missed the commit its predecessor decided: commit it now
                state = await self.updates.commit_missed(w) or state
            out = await self._sync([w])
            synced = out.acks.get(w)
            if synced is None:
                log.warning("worker %s announced itself but did not take the sync: %s", w, out.failures)
                return
            joined = self.registry.join(caps, synced)
            await self.updates.review([synced])
        if joined:
            log.info("worker %s joined (%s)", w, caps.model_name)
            self._notify()
            await self.fleet.event("worker_joined", [w])
        changed = _reconciled(state, synced)
        if changed:
            log.info("worker %s reconciled: %s", w, changed)
            await self.fleet.event("worker_reconciled", [w], changed)
        if synced.withheld:
            await self.fleet.event(
                "worker_stale",
                [w],
                f"holds {synced.weight_version} (seq {synced.weight_seq}), committed is {self.version.version} "
                f"(seq {self.version.seq}); push weights to bring it in step"
                + (" (quarantined: it missed a decided commit)" if w in self.updates.quarantined else ""),
            )
        if synced.session_id and synced.session_id != self.updates.session_id:
            await self.updates.abort_orphan(w, synced.session_id)
        self.repairs.poke()  # behind the committed weights: a healthy peer brings it there

    async def _sync(self, workers: list[str]) -> Outcome:
        """Bring `workers` to the desired state and the committed version (the caller holds the
        lock): one that does not hold exactly the committed (version, seq) stops serving."""
        return await self.fleet.send(
            stamped(
                SyncWorker,
                committed_version=self.version.version,
                seq=self.version.seq,
                desired=self.desired,
                liveness_s=self.opts.liveness_timeout_s,
                controller_id=self.id,
            ),
            workers,
            timeout=min(5.0, self.opts.command_timeout_s),
        )

    async def _resync(self, workers: list[str]) -> None:
        out = await self._sync(workers)
        if out.failures:
            log.warning("could not sync %s: %s", [f.worker_id for f in out.failures], out.failures)

    async def _still_leading(self, state: WorkerState) -> bool:
        """A worker obeys a newer epoch: the state was lost (recover it), or another controller
        took the lease while this one was cut off (a partition): then step down, never take an
        epoch above the new leader's."""
        try:
            await self._lease.confirm()
        except LeaseLost as e:
            self._step_down(e)
            return False
        except Unavailable as e:  # no quorum here: admit nobody now; the worker announces itself again
            log.warning(
                "worker %s obeys epoch %d, and this controller cannot confirm its lease: %s",
                state.worker_id,
                state.epoch,
                e,
            )
            return False
        return True

    async def _recover_lost_state(self, state: WorkerState) -> None:
        """A worker obeyed an epoch this controller's store does not know: the state bucket was
        lost while no controller ran. Take an epoch above every worker's, say so loudly, and
        publish no version until a push commits one (the committed version is unknown)."""
        lost_epoch = self.fleet.epoch
        self.fleet.epoch = await self.store.take_epoch(above=state.epoch)
        self.updates.forget_version(state.weight_seq)
        detail = (
            f"worker {state.worker_id} obeyed epoch {state.epoch} of controller {state.controller_id or '?'} but "
            f"the state store gave this controller {lost_epoch}: "
            f"the controller state was lost; now epoch {self.fleet.epoch}. The committed version is unknown: "
            "workers serve nothing until a push commits one"
        )
        log.error("%s", detail)
        await self._hello()  # the others re-announce and are synced under the new epoch
        await self.fleet.event("state_lost", [state.worker_id], detail)

    # ---- handlers ----------------------------------------------------------------------

    def _routes(self) -> Routes:
        """The controller's dispatch table. server_info reads memory only: answered inline."""
        r = Routes()
        # a first send's claim lands beside the fan-out; a refused one takes the fleet back
        r.add(Pause, self._pause, claims_beside="first_send")
        r.add(Resume, self._resume, claims_beside="first_send")
        r.add(IsPaused, self._status, read=True)
        r.add(Sleep, self._sleep)
        r.add(WakeUp, self._wake_up)
        r.add(IsSleeping, self._status, read=True)
        r.add(GetServerInfo, self._server_info, inline=True, read=True)
        # a read that takes the lock: it waits for a running push, so no commit lands mid-check
        r.add(VerifyWeights, lambda cmd: verify_weights(self.fleet, cmd), read=True)
        self.updates.routes(r)
        return r

    async def _desire(self, **changes: object) -> None:
        """Record what the trainer asked (before it is carried out: a worker admitted from
        now on is brought to it)."""
        self.desired = desired = msgspec.structs.replace(self.desired, **changes)
        if desired != self._kv_desired:  # written only when it changed (a second pause writes nothing)
            await self.store.put_desired(desired)
            self._kv_desired = desired

    @asynccontextmanager
    async def _taken_back_unless_claimed(self) -> AsyncIterator[None]:
        """Around a pause's or a resume's fan-out (under the lock): when its claim lands beside it
        (its first send, Route.claims_beside), wait for the claim once the fan-out ended, answered
        or failed. A claim the store refused (or that found an earlier run of the id) takes the
        fleet back to the run state desired before, and the claim's outcome answers. What cannot
        be taken back stays done: requests a pause aborted stay aborted (their callers saw them
        end with finish reason "abort", as on any abort)."""
        before = self.desired
        try:
            yield
        except Exception:
            await self._claimed_or_back(before)
            raise
        await self._claimed_or_back(before)

    async def _claimed_or_back(self, before: FleetState) -> None:
        try:
            await claimed()
        except ClaimOutcome as outcome:
            if self.desired == before:  # it changed nothing to take back (a second pause, a refused resume)
                raise
            log.warning("%s; the fleet goes back to %s", outcome, "paused" if before.paused else "running")
            try:
                await self._desire(paused=before.paused, pause_mode=before.pause_mode, paused_since=before.paused_since)
            except Exception as e:  # the store that refused the claim: the state is said again next time
                log.warning("the run state taken back was not kept in the state store: %s", e)
            back = stamped(PauseWorker, mode="keep") if before.paused else stamped(ResumeWorker)
            out = await self.fleet.send(back)  # keep: a request that started meanwhile resumes later
            if not out.ok:
                log.warning("taking the fleet back: %s", out.failures)
            raise

    async def _pause(self, cmd: Pause) -> FleetAck:
        async with self.fleet.lock, self._taken_back_unless_claimed():
            out = await alongside(
                self._desire(paused=True, pause_mode=cmd.mode, paused_since=self.desired.paused_since or time.time()),
                self.fleet.send_all(stamped(PauseWorker, mode=cmd.mode), f"pause(mode={cmd.mode})"),
            )
        await self.fleet.event("paused", sorted(out.acks), cmd.mode)
        return self.updates.ack(out)

    async def _resume(self, cmd: Resume) -> FleetAck:
        async with self.fleet.lock, self._taken_back_unless_claimed():
            self.updates.refuse_resume()
            out = await alongside(
                self._desire(paused=False, pause_mode=None, paused_since=None),
                self.fleet.send_all(stamped(ResumeWorker), "resume"),
            )
        await self.fleet.event("resumed", sorted(out.acks))
        return self.updates.ack(out)

    async def _sleep(self, cmd: Sleep) -> FleetAck:
        async with self.fleet.lock:
            workers = self.fleet.ids()
            no_sleep = [w for w in workers if not self.registry.capabilities(w).sleep_mode_enabled]
            if no_sleep:
                raise refuse(
                    f"workers {no_sleep} were started without sleep mode; restart them with --enable-sleep-mode",
                    dict.fromkeys(no_sleep, "started without sleep mode"),
                )
            # refuse before anything changes: a worker with requests in flight cannot sleep
            status = await self.fleet.send(stamped(StatusWorker), workers)
            status.raise_for_failures("sleep (status check)")
            busy = {w: st.in_flight for w, st in status.acks.items() if st.in_flight}
            if busy:
                raise refuse(
                    f"requests are in flight on {sorted(busy)}; pause with mode='abort' or 'wait' before sleeping",
                    {w: f"{n} requests in flight" for w, n in busy.items()},
                )
            out = await self.fleet.send(stamped(SleepWorker, level=cmd.level, tags=cmd.tags), workers)
            if not out.ok and out.acks and cmd.level == 1:
                # all or nothing: wake the workers that did fall asleep
                await self.fleet.send(stamped(WakeUpWorker, tags=cmd.tags), list(out.acks))
            out.raise_for_failures(f"sleep(level={cmd.level})")
            asleep = sorted(set(self.desired.sleeping_tags) | set(cmd.tags or SLEEP_TAGS))
            await self._desire(sleep_level=max(cmd.level, self.desired.sleep_level), sleeping_tags=asleep)
            if cmd.tags is None or "weights" in cmd.tags:
                await self.updates.weights_sleep()
            ack = self.updates.ack(out)
        await self.fleet.event("sleeping", [w.worker_id for w in ack.workers], f"level {cmd.level}")
        return ack

    async def _wake_up(self, cmd: WakeUp) -> FleetAck:
        async with self.fleet.lock:
            out = await self.fleet.send_all(stamped(WakeUpWorker, tags=cmd.tags), "wake_up")
            asleep = sorted(set(self.desired.sleeping_tags) - set(cmd.tags or SLEEP_TAGS))
            await self._desire(sleeping_tags=asleep, sleep_level=self.desired.sleep_level if asleep else 0)
        await self.fleet.event("awake", sorted(out.acks), ",".join(cmd.tags or ["all"]))
        return self.updates.ack(out)

    async def _status(self, cmd: IsPaused | IsSleeping) -> FleetAck:
        ack = self.updates.ack(await self.fleet.send_all(stamped(StatusWorker), "status"))
        if isinstance(cmd, IsPaused):
            return msgspec.structs.replace(ack, answer=all(w.paused for w in ack.workers))
        return msgspec.structs.replace(ack, answer=any(w.sleeping_tags for w in ack.workers))

    async def _server_info(self, cmd: GetServerInfo) -> ServerInfo:
        return ServerInfo(
            workers=self.registry.infos(self.version, self.updates.quarantined),
            capabilities=self.registry.aggregate(),
            epoch=self.epoch,
            weight_version=self.version.version,
            weight_seq=self.version.seq,
            draft_version=self.version.draft_version,
            session_id=self.updates.session_id,
            controller_id=self.id,
            desired=self.desired,
            repairing=dict(self.repairs.repairing) if not isinstance(self.repairs, _NotLeading) else {},
            repair_problem=self.repairs.problem if not isinstance(self.repairs, _NotLeading) else "",
            quarantined=sorted(self.updates.quarantined),
            push_lease=self.updates.leases.live(),
        )


def _reconciled(before: WorkerState, after: WorkerState) -> str:
    """What the sync changed on a worker, for its event ('' when nothing)."""
    parts = []
    if before.paused != after.paused:
        parts.append("paused" if after.paused else "resumed")
    if set(before.sleeping_tags) != set(after.sleeping_tags):
        parts.append(f"sleeping {sorted(after.sleeping_tags)}" if after.sleeping_tags else "woken")
    if after.withheld:
        parts.append(f"withheld from generation: holds {after.weight_version}")
    return ", ".join(parts)


class _NoLeases:
    """Before this controller leads: no push lease is known."""

    def touch(self, trainer_id: str | None) -> None:
        return None

    def live(self) -> None:
        return None

    def lapsed(self) -> None:
        return None


class _NotLeading:
    """Before this controller leads: no update session exists yet."""

    session: S.SessionState = S.Idle()
    session_id = None
    quarantined: frozenset[str] = frozenset()
    leases = _NoLeases()

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"controller is not leading yet ({name})")
