"""The controller's update sessions: transfer groups, sessions, the two-phase finish and the
committed version. `Updates` owns the session state, the committed version and its durable
record, the last commit decision and the workers quarantined by it; it sends through the Fleet
(fleet.py) under the fleet's one lock.

Finish is a two-phase commit with a durable decision: every worker prepares (verifies what it
staged); then the decision (version, seq, target, the manifest of checksums) is written to the
state store, and only then does any worker commit. Before the decision any failure aborts
everywhere; from it on the outcome is commit: a worker that fails or misses its commit is
quarantined (withheld from generation, named) until it holds exactly the committed bits. A
commit that loaded into an engine cannot be taken back, so the decision is the commit point."""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

import anyio
import msgspec
from rlbus.schemas import (
    DEFAULT_VERSION,
    Aborted,
    AbortWeightUpdate,
    AbortWeightUpdateWorker,
    CommitDecision,
    CommitWorker,
    ControlCommand,
    FailedPrecondition,
    FinishWeightUpdate,
    FleetAck,
    GetWeightVersion,
    InitWeightTransfer,
    InitWeightTransferWorker,
    InvalidArgument,
    PrepareWorker,
    StartWeightUpdate,
    StartWeightUpdateWorker,
    StatusWorker,
    UpdateTarget,
    UpdateWeights,
    UpdateWeightsWorker,
    UpdateWeightVersion,
    UpdateWeightVersionWorker,
    VersionInfo,
    WorkerFailure,
    WorkerState,
    checksums_problem,
    encode,
    error_for,
    refuse,
    tensor_checksums_problem,
    version_problem,
)
from rlbus.services.endpoints import Routes, after_reply, claimed

from rlbus.bus.confirmed import ConfirmedInOrder
from rlbus.bus.once import once

from . import session as S
from .fanout import Outcome
from .fleet import Fleet, alongside, stamped, together
from .pushlease import PUSH_LEASE_S, PushLeases
from .store import StateStore

log = logging.getLogger("rlbus.controller.updates")

ABORTED_KEPT = 64
"""Aborted sessions remembered, to tell a late finish or update why its session is gone."""


class Updates:
    def __init__(
        self,
        fleet: Fleet,
        store: StateStore,
        version: VersionInfo | None = None,
        *,
        unique_versions: bool = False,
        push_lease_s: float = PUSH_LEASE_S,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.leases = PushLeases(store, push_lease_s)
        """One trainer at a time: the fleet's push lease."""
        self.unique_versions = unique_versions
        """Refuse a version string that was committed before."""
        self.version = version or VersionInfo(version=DEFAULT_VERSION)
        """The committed version (KV holds it durably)."""
        self.session: S.SessionState = S.Idle()
        self.state_lost = False
        """The durable state was lost: the committed version is unknown until a push commits."""
        self._kv_session: str | None = None
        """The open session KV records."""
        self.decision: CommitDecision | None = None
        """The last decided commit (KV holds it): its manifest, and whom it quarantined."""
        self.quarantined: dict[str, UpdateTarget] = {}
        """Workers that failed or missed a decided commit (of which target): withheld until they
        hold the committed bits of it."""
        self._aborted: OrderedDict[str, str] = OrderedDict()
        """The last sessions aborted (id: why): a finish or update that names one hears why
        (ABORTED), not that no session is open. A finish whose controller stopped before its
        claim landed has its retry answered so by the successor (which aborted the session)."""
        self.withhold: Callable[[list[str]], Awaitable[None]] = _nobody_withholds
        """Brings workers to the committed version (the service's SyncWorker): a worker that does not
        hold it stops serving generation."""
        self._events = ConfirmedInOrder(fleet.nc, fleet.subjects.version, store.patience_s)
        """rl.version events, in commit order: one published again on a new link (its first went
        out into a link that died) still lands before the next commit's. (`_recorded` already
        waits for the last confirmation before the next publish; this keeps the order a property
        of the publisher, tested on its own in tests/integration/test_confirmed_publish.py.)"""
        self._recording: Callable[[], Awaitable[None]] | None = None
        """The last commit's record, finished after its reply (`_commit_version`): the version's
        write acknowledged, its rl.version event confirmed, its decision marked done. The next
        commit runs it again first if it failed."""
        self.unrecorded = False
        """The last commit's record failed after its reply (the store refused it for its whole
        patience). The controller's sweep runs it again (`record_again`) until it lands, so its
        rl.version event does not wait for the next commit to say it."""

    def routes(self, r: Routes) -> None:
        r.add(InitWeightTransfer, self.init_weight_transfer)
        r.add(StartWeightUpdate, self.start_weight_update, claims_beside=True)
        r.add(UpdateWeights, self.update_weights)
        r.add(FinishWeightUpdate, self.finish_weight_update, recover=self.decided_answer, claims_beside=True)
        r.add(AbortWeightUpdate, self.abort_weight_update)
        r.add(UpdateWeightVersion, self.update_weight_version)
        r.add(GetWeightVersion, self.get_weight_version, read=True)

    @property
    def session_id(self) -> str | None:
        return getattr(self.session, "session_id", None)

    def ack(self, out: Outcome) -> FleetAck:
        ack = self.fleet.ack(out, session_id=self.session_id, weight_version=self.version.version)
        return msgspec.structs.replace(ack, quarantined=sorted(self.quarantined)) if self.quarantined else ack

    # ---- the session state machine ---------------------------------------------------

    def _advance(self, event: S.Event) -> S.Step:
        """What the state machine makes of `event` (nothing changes yet); raises its refusal."""
        out = S.step(self.session, event)
        if out.refusal is not None:
            raise error_for(out.refusal.code, out.refusal.message)
        return out

    async def _apply(self, event: S.Event, reason: str) -> S.Step:
        """Step the machine and do what it says: settle in its new state, and when it closed an
        open session (abort_workers), tell every worker to drop what it staged."""
        sid = self.session_id
        step = self._advance(event)
        await self._settle(step.state)
        if step.abort_workers:
            await self._abort_everywhere(sid, reason)
        return step

    async def _settle(self, state: S.SessionState, *, ahead: bool = False) -> None:
        """Move to `state` and keep KV's record of the open session in step with it. Compared
        with what KV holds, not with the previous in-memory state: finish and its failure
        paths step through Committing/Failed in memory before settling here. `ahead`: the
        write goes out ahead of the command's reply and is acknowledged after it."""
        self.session = state
        sid = self.session_id
        if sid != self._kv_session:
            await self.store.put_session(sid, ahead=ahead)
            self._kv_session = sid

    def refuse_resume(self) -> None:
        """Nothing uncommitted is served: while a session is open on workers that update in
        place, generation stays paused until finish or abort."""
        if isinstance(self.session, S.Idle):
            return
        registry = self.fleet.registry
        in_place = [w for w in registry.ids() if registry.capabilities(w).update_mode == "in_place"]
        if in_place:
            raise FailedPrecondition(
                f"session {self.session_id} is open and workers {in_place} update in place: their weights are "
                "being overwritten; finish or abort the session before resuming"
            )

    def forget_version(self, seq_seen: int) -> None:
        """The committed version is unknown (the store was lost): no worker counts as current
        until a push commits, and the next commit's sequence passes every one seen."""
        self.state_lost = True
        self.version = VersionInfo(version=DEFAULT_VERSION, seq=max(self.version.seq, seq_seen))

    async def weights_sleep(self) -> None:
        """Weights are going to sleep (the caller holds the lock): no session survives that."""
        await self._apply(S.SleepWeights(), "weights went to sleep")

    def aborted(self, sid: str, why: str) -> None:
        """Remember that session `sid` was aborted, and why."""
        self._aborted[sid] = why
        while len(self._aborted) > ABORTED_KEPT:
            self._aborted.popitem(last=False)

    def _refuse_an_aborted_session(self, sid: str | None) -> None:
        if sid is not None and sid != self.session_id and sid in self._aborted:
            raise Aborted(f"session {sid} was aborted ({self._aborted[sid]}); nothing of it commits: push again")

    async def _abort_everywhere(self, sid: str | None, reason: str) -> None:
        if sid is not None:
            self.aborted(sid, reason)
        ids = self.fleet.registry.ids()
        if ids:
            await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=sid, reason=reason), ids)
        await self.fleet.event("session_aborted", ids, reason, session_id=sid)

    async def abort_on_loss(self, worker_id: str) -> None:
        async with self.fleet.lock:
            if isinstance(self.session, S.Open):  # Committing is resolved by finish itself
                await self._apply(S.WorkerLost(worker_id), f"worker {worker_id} left during the session")

    async def abort_orphan(self, worker_id: str, session_id: str) -> None:
        """Drop a session a worker holds that this controller does not (from before a restart)."""
        async with self.fleet.lock:
            if session_id != self.session_id:
                await self.fleet.send(
                    stamped(AbortWeightUpdateWorker, session_id=session_id, reason="orphaned session"), [worker_id]
                )

    # ---- the decided commit and its quarantine -------------------------------------------

    def _next_seq(self, main: bool) -> int:
        """The next commit sequence of a target: past every one committed or decided (a seq
        names one set of bits forever, also when its commit was never recorded)."""
        seq = self.version.seq if main else self.version.draft_seq
        d = self.decision
        if d is not None and (d.target == "main") == main:
            seq = max(seq, d.seq)
        return seq + 1

    def holds_committed(self, state: WorkerState, target: UpdateTarget = "main") -> bool:
        """The worker holds exactly the committed bits of `target` (version and seq)."""
        v = self.version
        if target == "draft":
            return state.draft_seq == v.draft_seq
        return state.weight_version == v.version and state.weight_seq == v.seq and not state.dirty

    async def review(self, states: Iterable[WorkerState]) -> None:
        """Release every quarantined worker among `states` that now holds the committed bits
        (the trainer's next push reached it, or a repair did). Under the lock."""
        released = sorted(
            s.worker_id
            for s in states
            if s.worker_id in self.quarantined and self.holds_committed(s, self.quarantined[s.worker_id])
        )
        if released:
            for w in released:
                del self.quarantined[w]
            await self._keep_quarantine()
            await self.fleet.event("worker_released", released, "holds the committed weights again")

    async def _keep_quarantine(self) -> None:
        if self.decision is not None and sorted(self.quarantined) != self.decision.quarantined:
            self.decision = msgspec.structs.replace(self.decision, quarantined=sorted(self.quarantined))
            await self.store.put_decision(self.decision)

    async def _quarantine(self, decision: CommitDecision, failures: list[WorkerFailure]) -> None:
        """Workers that failed or missed the decided commit: quarantined and named. One that
        answered (its commit failed there) drops what it staged and is synced, so it stops
        serving at once; one that did not answer (dead, frozen) withholds itself when it comes
        back (it was silent, or restarted, and is synced before it serves)."""
        missed = sorted(f.worker_id for f in failures)
        self.quarantined.update(dict.fromkeys(missed, decision.target))
        alive = [f.worker_id for f in failures if f.code not in ("DEADLINE_EXCEEDED", "UNAVAILABLE")]
        if alive:
            await self.fleet.send(
                stamped(AbortWeightUpdateWorker, session_id=decision.session_id, reason="its commit failed"),
                alive,
                timeout=min(5.0, self.fleet.command_timeout_s),
            )
            await self.withhold(alive)
        detail = "; ".join(f"{f.worker_id}: {f.code}: {f.message}" for f in failures)
        log.error(
            "commit seq %d (%s) stands; quarantined %s: %s", decision.seq, decision.committed.version, missed, detail
        )
        await self.fleet.event(
            "worker_quarantined",
            missed,
            f"missed the decided commit seq {decision.seq} ({detail}); withheld until it holds those bits",
            session_id=decision.session_id,
        )

    async def take_over(self, decision: CommitDecision | None, open_session: str | None) -> None:
        """A controller that starts finds the last decision: one its predecessor decided but
        did not record is finished now (the version recorded and published once); the workers
        that hold its session prepared commit it when they announce themselves (`finish_for`)."""
        if decision is None:
            return
        self.decision = decision
        # the store keeps who, not for which target: a takeover counts them against the last decision's
        self.quarantined = dict.fromkeys(decision.quarantined, decision.target)
        if decision.published:
            return
        log.warning(
            "commit seq %d of session %s was decided by the last controller and not recorded; finishing it",
            decision.seq,
            decision.session_id,
        )
        self.quarantined.update(dict.fromkeys(decision.workers, decision.target))  # released once each shows the bits
        await self._record(decision)
        if open_session == decision.session_id:
            await self.store.put_session(None)

    def finish_for(self, state: WorkerState) -> bool:
        """The worker holds the decided session prepared (it missed the commit): commit it."""
        d = self.decision
        return d is not None and state.session_id == d.session_id and self._decided_is_latest(d)

    def _decided_is_latest(self, d: CommitDecision) -> bool:
        v = self.version
        return (v.seq if d.target == "main" else v.draft_seq) == d.seq

    async def commit_missed(self, worker_id: str) -> WorkerState | None:
        """Send the decided commit to a worker that missed it (under the lock)."""
        d = self.decision
        assert d is not None
        commit = stamped(CommitWorker, session_id=d.session_id, weight_version=d.weight_version, seq=d.seq)
        out = await self.fleet.send(commit, [worker_id])
        if out.failures:
            log.warning("worker %s could not take the decided commit seq %d: %s", worker_id, d.seq, out.failures)
        return out.acks.get(worker_id)

    # ---- the push lease ----------------------------------------------------------------

    async def _take_lease(self, cmd: ControlCommand, what: str, *, persist: bool = True) -> bool:
        """Before anything is dispatched (under the lock): refuse another holder's trainer, drop a
        session whose holder's lease lapsed, and take the lease (`persist` False: in memory; the
        caller keeps it in the store before it answers). True when it was not held yet (the
        command gives it back if it fails)."""
        self.leases.refuse_others(cmd.trainer_id, what)
        lapsed = self.leases.lapsed()
        if lapsed is not None and lapsed.trainer_id != cmd.trainer_id and isinstance(self.session, S.Open):
            await claimed()  # a command claimed beside its handler aborts nothing before its claim lands
            await self._apply(
                S.Abort(),
                f"the push lease of trainer {lapsed.trainer_id!r} lapsed (it sent nothing for "
                f"{lapsed.lease_s:g}s): its session is abandoned",
            )
        fresh = self.leases.live() is None
        if persist:
            await self.leases.claim(cmd.trainer_id)
        else:
            self.leases.grant(cmd.trainer_id)
        return fresh

    async def drop_lapsed_lease(self) -> None:
        """The push lease's holder stopped sending: free the lease, and abort the session it
        left open (a dead trainer blocks the fleet no longer than the lease)."""
        if self.leases.lapsed() is None:
            return
        async with self.fleet.lock:
            lapsed = self.leases.lapsed()
            if lapsed is None:
                return
            log.warning(
                "the push lease of trainer %r lapsed (nothing from it for %gs); releasing it",
                lapsed.trainer_id,
                lapsed.lease_s,
            )
            if isinstance(self.session, S.Open):
                await self._apply(
                    S.Abort(),
                    f"the push lease of trainer {lapsed.trainer_id!r} lapsed (nothing from it "
                    f"for {lapsed.lease_s:g}s): its session is abandoned",
                )
            await self.leases.release(lapsed.trainer_id)

    async def _keep_lease(self, cmd: ControlCommand, what: str) -> None:
        """A session command: refused when another trainer holds the lease; renews (or re-takes) it."""
        self.leases.refuse_others(cmd.trainer_id, what)
        if self.leases.live() is None:
            await self.leases.claim(cmd.trainer_id)
        else:
            self.leases.touch(cmd.trainer_id)

    # ---- handlers ----------------------------------------------------------------------

    async def init_weight_transfer(self, cmd: InitWeightTransfer) -> FleetAck:
        async with self.fleet.lock:
            fresh = await self._take_lease(cmd, "init_weight_transfer")
            try:
                return await self._init_weight_transfer(cmd)
            except BaseException:
                if fresh:  # it took the lease for nothing: free it at once
                    with anyio.CancelScope(shield=True):
                        await self.leases.release(cmd.trainer_id)
                raise

    async def _init_weight_transfer(self, cmd: InitWeightTransfer) -> FleetAck:
        """Under the lock, holding the push lease: every worker joins the trainer's group."""
        if not isinstance(self.session, S.Idle):
            raise FailedPrecondition(f"session {self.session_id} is open; finish or abort it first")
        init = cmd.init_info
        registry = self.fleet.registry
        workers = self.fleet.ids()
        backends = {w: registry.capabilities(w).weight_transfer_backend for w in workers}
        missing = [w for w, b in backends.items() if b is None]
        if missing:
            raise refuse(
                f"workers {missing} have no weight transfer backend; start them with --weight-transfer-backend",
                dict.fromkeys(missing, "no weight transfer backend"),
            )
        if len(set(backends.values())) > 1:
            raise refuse(
                f"workers disagree on the transfer backend: {backends}",
                {w: f"backend {b}" for w, b in backends.items()},
            )
        fleet_backend = next(iter(backends.values()))
        wanted = cmd.backend or init.backend
        if wanted != fleet_backend or init.backend != fleet_backend:
            raise FailedPrecondition(f"the fleet's backend is {fleet_backend}, not {wanted}")
        ranks, needed = registry.transfer_ranks(workers, init.rank_offset)
        if init.world_size != needed:
            raise FailedPrecondition(
                f"world_size {init.world_size} does not match the fleet: {len(workers)} workers with {needed - init.rank_offset} "
                f"transfer ranks + rank_offset {init.rank_offset}; read server_info() again and retry"
            )
        timeout = max(self.fleet.command_timeout_s, init.timeout_s + 5)
        out = await self.fleet.send(
            lambda w, epoch, cid: InitWeightTransferWorker(epoch=epoch, command_id=cid, init_info=init, rank=ranks[w]),
            workers,
            timeout=timeout,
        )
        out.raise_for_failures("init_weight_transfer")
        await self.leases.claim(cmd.trainer_id, group=init.group_name)  # its start checks the fleet is still there
        return self.ack(out)

    async def start_weight_update(self, cmd: StartWeightUpdate) -> FleetAck:
        async with self.fleet.lock:
            fresh = await self._take_lease(cmd, f"start_weight_update({cmd.target})", persist=False)
            try:
                out, sid, workers = await self._start_weight_update(cmd)
            except BaseException:
                if fresh:  # nothing opened: the lease is free again
                    with anyio.CancelScope(shield=True):
                        await self.leases.release(cmd.trainer_id)
                raise
        await self.fleet.event("session_started", workers, cmd.target, session_id=sid)
        return self.ack(out)

    async def _start_weight_update(self, cmd: StartWeightUpdate) -> tuple[Outcome, str, list[str]]:
        """Under the lock, holding the push lease: open the session on every worker."""
        target = cmd.target
        registry = self.fleet.registry
        workers = self.fleet.ids()
        group = self.leases.group_of(cmd.trainer_id)
        moved = {w: registry.state(w).transfer_group for w in workers}
        moved = {w: g for w, g in moved.items() if group is not None and g != group}
        if moved:
            raise refuse(
                f"workers {sorted(moved)} left transfer group {group!r} that this trainer built (another "
                "trainer's init_weight_transfer since, or they restarted): no byte would reach them; call "
                "init_weight_transfer() again",
                {w: f"in transfer group {g!r}" for w, g in moved.items()},
            )
        if target == "draft" and not registry.aggregate().supports_draft_weight_updates:
            lacking = [w for w in workers if not registry.capabilities(w).supports_draft_weight_updates]
            raise refuse(
                f"workers {lacking} cannot update a draft model (no draft, speculation off, or the backend does not support it)",
                dict.fromkeys(lacking, "cannot update a draft model"),
            )
        asleep = [w for w in workers if "weights" in registry.state(w).sleeping_tags]
        if asleep:
            raise refuse(
                f"weights are asleep on {asleep}; call wake_up(tags=['weights']) first "
                "(after a level-2 sleep: wake weights -> update -> wake kv_cache)",
                dict.fromkeys(asleep, "weights asleep"),
            )
        serving = [
            w for w in workers if registry.capabilities(w).update_mode == "in_place" and not registry.state(w).paused
        ]
        if serving:
            raise refuse(
                f"workers {serving} update in place (bytes land in the live weights) and are not paused; "
                "pause first (push_weights does), so nothing uncommitted is served",
                dict.fromkeys(serving, "updates in place and is not paused"),
            )
        sid = uuid.uuid4().hex[:16]
        step = self._advance(S.Start(session_id=sid, target=target, epoch=self.fleet.epoch))
        begin = stamped(StartWeightUpdateWorker, target=target, session_id=sid, base_seq=cmd.base_seq)
        try:
            # the start's claim, the session's record and the push lease are kept beside the fan-out,
            # durable before the answer (a controller that dies in between leaves a record its
            # successor aborts everywhere); a claim refused or found taken aborts what opened
            out = await alongside(
                together(claimed(), self._keep_open(sid), self.leases.persist()), self.fleet.send(begin, workers)
            )
        except BaseException:  # the caller's deadline passed, or the store took no write: close what opened
            with anyio.CancelScope(shield=True):
                await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=sid, reason="start failed"), workers)
                await self._forget_open()
            raise
        if not out.ok:
            await self.fleet.send(
                stamped(AbortWeightUpdateWorker, session_id=sid, reason="start failed"), list(out.acks)
            )
            await self._forget_open()
            out.raise_for_failures(f"start_weight_update({target})")
        await self._settle(step.state)  # KV holds it already: nothing more is written
        return out, sid, workers

    async def _keep_open(self, sid: str) -> None:
        await self.store.put_session(sid)
        self._kv_session = sid

    async def _forget_open(self) -> None:
        """A start that failed: KV's record back to the session memory holds (none)."""
        try:
            await self._settle(self.session)
        except Exception as e:  # the start's own failure is the one to raise; a successor aborts the record
            log.warning("the record of a session that failed to start was not cleared: %s", e)

    async def update_weights(self, cmd: UpdateWeights) -> FleetAck:
        async with self.fleet.lock:
            self.leases.refuse_others(cmd.trainer_id, "update_weights")
            self._refuse_an_aborted_session(cmd.session_id)
            step = self._advance(S.Update(session_id=cmd.session_id))
            await self._keep_lease(cmd, "update_weights")
            elsewhere = {w: self.fleet.registry.state(w).transfer_group for w in self.fleet.ids()}
            elsewhere = {w: g for w, g in elsewhere.items() if g != cmd.group}
            if cmd.group and elsewhere:
                raise refuse(
                    f"workers {sorted(elsewhere)} are not in transfer group {cmd.group!r} (another trainer's "
                    "init_weight_transfer, or they left it): no byte would reach them; call init_weight_transfer() again",
                    {w: f"in transfer group {g!r}" for w, g in elsewhere.items()},
                )
            assert isinstance(step.state, S.Open)  # an Update only ever steps to Open
            sid = step.state.session_id
            workers = self.fleet.ids()

            def receive(check_only: bool):
                return stamped(
                    UpdateWeightsWorker, session_id=sid, params=cmd.params, buckets=cmd.buckets, check_only=check_only
                )

            # every worker checks names, dtypes and shapes before any byte moves
            check = await self.fleet.send(receive(True), workers)
            check.raise_for_failures("update_weights (metadata check)")
            out = await self.fleet.send(receive(False), workers)
            if not out.ok:
                err = out.error("update_weights")
                await self._apply(S.Failed(reason=err.message), err.message)
                raise err
            await self._settle(step.state)
            return self.ack(out)

    async def finish_weight_update(self, cmd: FinishWeightUpdate) -> FleetAck:
        if cmd.weight_version is not None and (problem := version_problem(cmd.weight_version)):
            raise InvalidArgument(problem)
        if problem := checksums_problem(cmd.checksums) or tensor_checksums_problem(cmd.tensor_checksums):
            raise InvalidArgument(problem)
        async with self.fleet.lock:
            self.leases.refuse_others(cmd.trainer_id, "finish_weight_update")
            self._refuse_an_aborted_session(cmd.session_id)
            if cmd.weight_version is not None:
                await self._refuse_a_used_version(cmd.weight_version)
            self._advance(S.Finish(version=cmd.weight_version, session_id=cmd.session_id))  # refused: nothing changed
            try:
                return await self._finish(cmd)
            finally:
                if isinstance(self.session, S.Idle):  # committed or aborted: the push is over
                    with anyio.CancelScope(shield=True):
                        await self.leases.release(cmd.trainer_id)

    async def decided_answer(self, cmd: FinishWeightUpdate) -> FleetAck | None:
        """A finish retried after the controller running it stopped before it answered: when
        its session's commit was decided (and recorded, by this controller's takeover), the
        commit stands, and the retry gets the fleet's ack on it. None: nothing was decided."""
        d = self.decision
        if d is None or not d.published or cmd.session_id is None or d.session_id != cmd.session_id:
            return None
        async with self.fleet.lock:
            return self.ack(await self.fleet.send(stamped(StatusWorker), self.fleet.ids()))

    async def _finish(self, cmd: FinishWeightUpdate) -> FleetAck:
        """Under the lock: phase 1 (prepare), the decision, phase 2 (commit)."""
        committing = (await self._apply(S.Finish(version=cmd.weight_version, session_id=cmd.session_id), "")).state
        if not isinstance(committing, S.Committing):
            raise error_for("INTERNAL", f"finish stepped to {type(committing).__name__}, not Committing")
        sid = committing.session_id
        workers = self.fleet.ids()
        try:
            prepared = await self.fleet.send(
                stamped(PrepareWorker, session_id=sid, checksums=cmd.checksums, tensor_checksums=cmd.tensor_checksums),
                workers,
            )
        except BaseException:  # the caller's deadline passed: the session cannot stay Committing
            with anyio.CancelScope(shield=True):
                await self._apply(S.Failed(reason="finish ran out of time"), "finish ran out of time in prepare")
            raise
        try:
            # the finish's claim in the answer store, sent as it started, lands beside phase 1 (which
            # only checks): nothing is decided, and no failure aborts the session, before it has
            await claimed()
        except BaseException:  # refused (no quorum), an earlier run answers, or the deadline: as before the finish
            with anyio.CancelScope(shield=True):
                await self._apply(S.Reopen(), "")
            raise
        if not prepared.ok:
            err = prepared.error("finish_weight_update (prepare)")
            await self._apply(S.Failed(reason=err.message), err.message)
            raise err
        with anyio.CancelScope(shield=True):  # from the decision on, the commit completes (each worker is bounded)
            decision = await self._decide(committing, cmd, workers)
            # the version is written after phase 2, not beside it: that write, acknowledged by the
            # store's quorum, is what holds rl.version back while a node that died in phase 2 is
            # still taking messages it will never pass on (tests/integration/test_cluster_soak.py)
            committed = await self.fleet.send(
                stamped(CommitWorker, session_id=sid, weight_version=decision.weight_version, seq=decision.seq), workers
            )
            return await self._committed(decision, committed, cmd.trainer_id)

    async def _decide(self, committing: S.Committing, cmd: FinishWeightUpdate, workers: list[str]) -> CommitDecision:
        """Every worker prepared: write the decision to the state store, before any worker
        commits. A store that cannot take it fails the finish (aborted everywhere, as any
        failure before the decision)."""
        main = committing.target == "main"
        seq = self._next_seq(main)
        version, sid, now = committing.version, committing.session_id, time.time()
        if main:
            new = msgspec.structs.replace(
                self.version,
                version=version or self.version.version,
                seq=seq,
                epoch=self.fleet.epoch,
                session_id=sid,
                workers=len(workers),
                time=now,
            )
        else:
            new = msgspec.structs.replace(
                self.version,
                draft_version=version or self.version.draft_version,
                draft_seq=seq,
                epoch=self.fleet.epoch,
                session_id=sid,
                workers=len(workers),
                time=now,
            )
        decision = CommitDecision(
            session_id=sid,
            target=committing.target,
            weight_version=version,
            seq=seq,
            committed=new,
            workers=workers,
            checksums=cmd.checksums,
            tensor_checksums=cmd.tensor_checksums,
            quarantined=sorted(self.quarantined),
            epoch=self.fleet.epoch,
            time=now,
        )
        step = self._advance(S.Decide(seq))
        try:
            await self._recorded()  # the last commit durable and said before this one is decided
            await self.store.put_decision(decision)
        except Exception as e:
            await self._apply(S.Failed(reason=str(e)), f"the commit decision could not be kept: {e}")
            raise
        self.decision = decision
        await self._settle(step.state)
        return decision

    async def _committed(self, decision: CommitDecision, committed: Outcome, trainer_id: str | None) -> FleetAck:
        """Phase 2 answered: the decided commit stands whatever the workers said; record it (and
        free `trainer_id`'s push lease), and quarantine every worker that failed or missed it.
        Runs shielded, under the lock."""
        if committed.failures:
            await self._quarantine(decision, committed.failures)
        await self._record(decision, lambda: self.leases.release(trainer_id, ahead=True))
        await self.review(committed.acks.values())  # workers it brought to the committed bits again
        return self.ack(committed)

    async def _record(self, decision: CommitDecision, closing: Callable[[], Awaitable[None]] | None = None) -> None:
        """The decided version recorded: its write, the session closed and `closing` (the push
        lease freed) go out ahead of the finish's reply on the controller's one connection and
        are acknowledged after it (endpoints.after_reply): the server has them before the
        trainer has the reply, and the reply waits for no round trip of theirs. After the
        version's acknowledgement, rl.version says it, then the decision is marked done
        (`_commit_version`). A successor finds a decision not marked done (the controller died
        first, or a write was lost with the node that took it) and records it again; one outside
        a command (a takeover) waits for all of it."""
        new = decision.committed
        self.decision = done = msgspec.structs.replace(decision, published=True, quarantined=sorted(self.quarantined))
        mark_done = self.store.decision_later(done)
        await self._commit_version(new, then=mark_done)  # durable before KV forgets the session
        self.state_lost = False
        if isinstance(self.session, S.Decided) and self.session.session_id == decision.session_id:
            await self._settle(self._advance(S.CommitDone()).state, ahead=True)
        if closing is not None:
            await closing()
        await self.fleet.event(
            "session_committed",
            decision.workers,
            new.version if decision.target == "main" else new.draft_version or "",
            session_id=decision.session_id,
        )

    async def _refuse_a_used_version(self, version: str) -> None:
        """With unique_versions on: refuse a version string that was committed before (the
        session, if any, stays open: finish again with another version, or abort)."""
        if not self.unique_versions:
            return
        seq = await self.store.committed_seq(version)
        if seq is not None:
            raise InvalidArgument(
                f"version {version!r} was committed before (seq {seq}); this controller refuses to reuse a version "
                "string (unique_versions); pick a new one"
            )

    async def _recorded(self) -> None:
        """The last commit's record is finished: awaited (or run again, if it failed) before
        another version is decided or set. Raises UNAVAILABLE while the store still refuses it."""
        if self._recording is not None:
            await self._recording()
        self.unrecorded = False

    async def record_again(self) -> None:
        """The last commit's record, run again after it failed (the sweep, while `unrecorded`).
        Raises UNAVAILABLE while the store still refuses it."""
        await self._recorded()

    async def _record_after_reply(self) -> None:
        try:
            await self._recorded()
        except Exception:
            self.unrecorded = True
            raise

    async def _commit_version(
        self, info: VersionInfo, then: Callable[[], Awaitable[Callable[[], Awaitable[object]]]] | None = None
    ) -> None:
        """The version's write (with unique_versions the version string's record beside it)
        goes out ahead of the reply; after the reply, once the store's quorum acknowledged it,
        the event (a subscriber never sees a version KV lacks: a node that died in phase 2
        holds the write back until the controller is on a survivor), with `then` sent right
        behind it (the decision marked done: a successor that finds it not done records and
        publishes the version again), then the event confirmed (bus/confirmed.py: one lost with
        its link is published again on the next) and `then` acknowledged.
        A commit answered before its version is durable still stands: its decision was durable
        before any worker committed. Without `then` (a version set with no decision behind it)
        the write is acknowledged and the event published before the reply, as nothing else
        would say it after a crash. The next commit waits for all of it (`_recorded`)."""
        await self._recorded()
        durable = await self.store.version_ahead(info, unique=self.unique_versions)
        if then is None:  # no decision a successor could record it from: durable and said before the reply
            await durable()
            self.version = info
            confirm = await self._events.publish(encode(info))

            async def record() -> None:
                await confirm()

        else:
            self.version = info

            async def record() -> None:
                await durable()
                confirm = await self._events.publish(encode(info))
                marked = await then()  # right behind the event on the connection: said once
                await confirm()
                await marked()

        self._recording = once(record)
        await after_reply(self._record_after_reply, "the committed version's record")

    async def abort_weight_update(self, cmd: AbortWeightUpdate) -> FleetAck:
        reason = cmd.reason or "aborted by the trainer"
        async with self.fleet.lock:
            self.leases.refuse_others(cmd.trainer_id, "abort_weight_update")
            sid = self.session_id
            step = self._advance(S.Abort(session_id=cmd.session_id))
            workers = self.fleet.ids()
            await self._settle(step.state)
            await self.leases.release(cmd.trainer_id)
            # abort_workers when a session was open; with none open the trainer's abort still
            # sweeps any session a worker holds (e.g. one a crashed controller left): None = any
            out = await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=sid, reason=reason), workers)
        if sid:
            await self.fleet.event("session_aborted", workers, reason, session_id=sid)
        return self.ack(out)

    async def update_weight_version(self, cmd: UpdateWeightVersion) -> FleetAck:
        if problem := version_problem(cmd.new_version):
            raise InvalidArgument(problem)
        async with self.fleet.lock:
            if self.state_lost:
                raise FailedPrecondition(
                    "the controller state was lost, so which weights the workers hold is not known: push weights "
                    "(push_weights) to commit a version before renaming it"
                )
            self.leases.refuse_others(cmd.trainer_id, "update_weight_version")
            self._advance(S.VersionSet())
            await self._recorded()  # the last commit durable and said before a version is set
            await self._refuse_a_used_version(cmd.new_version)
            workers = self.fleet.ids()
            seq = self.version.seq + 1
            out = await self.fleet.send(
                stamped(UpdateWeightVersionWorker, new_version=cmd.new_version, seq=seq), workers
            )
            out.raise_for_failures("update_weight_version")
            await self._commit_version(
                msgspec.structs.replace(
                    self.version,
                    version=cmd.new_version,
                    seq=seq,
                    epoch=self.fleet.epoch,
                    session_id=None,
                    workers=len(workers),
                    time=time.time(),
                )
            )
            return self.ack(out)

    async def get_weight_version(self, cmd: GetWeightVersion) -> VersionInfo:
        out = await self.fleet.send(stamped(StatusWorker))
        out.raise_for_failures("get_weight_version")
        seen = {w: st.weight_version for w, st in out.acks.items()}
        if len(set(seen.values())) != 1:
            groups: dict[str, list[str]] = {}
            for w, v in sorted(seen.items()):
                groups.setdefault(v, []).append(w)
            raise refuse(
                "workers disagree on the weight version: "
                + "; ".join(f"{v}: {ws}" for v, ws in groups.items())
                + f" (committed: {self.version.version}); push weights again to bring them in step",
                {w: f"holds {v}" for w, v in seen.items() if v != self.version.version},
            )
        held = next(iter(seen.values()))
        if held != self.version.version:
            # e.g. a controller died between its commit fan-out and its KV write: the workers agree on
            # weights that were never committed (and they are withheld from generation until a push)
            raise refuse(
                f"workers {sorted(seen)} all hold {held!r} but the committed version is {self.version.version!r} "
                f"(seq {self.version.seq}); push weights again to bring them in step",
                {w: f"holds {held}" for w in seen},
            )
        return msgspec.structs.replace(self.version, workers=len(seen))


async def _nobody_withholds(workers: list[str]) -> None:
    return None
