"""The controller's update sessions: transfer groups, sessions, the two-phase finish and the
committed version. `Updates` owns the session state, the committed version and its durable
record; it sends through the Fleet (fleet.py) under the fleet's one lock."""

from __future__ import annotations

import time
import uuid

import anyio
import msgspec

from rlbus.schemas import (
    DEFAULT_VERSION,
    AbortWeightUpdateWorker,
    AbortWeightUpdate,
    CommitWorker,
    FailedPrecondition,
    FinishWeightUpdate,
    FleetAck,
    StatusWorker,
    GetWeightVersion,
    InitWeightTransfer,
    InvalidArgument,
    InitWeightTransferWorker,
    StartWeightUpdateWorker,
    PrepareWorker,
    UpdateWeightsWorker,
    UpdateWeightVersionWorker,
    StartWeightUpdate,
    UpdateWeights,
    UpdateWeightVersion,
    VersionInfo,
    checksums_problem,
    encode,
    error_for,
    refuse,
    tensor_checksums_problem,
    version_problem,
)
from rlbus.services.endpoints import Routes

from . import session as S
from .fanout import Outcome
from .fleet import Fleet, stamped
from .store import StateStore


class Updates:
    def __init__(self, fleet: Fleet, store: StateStore, version: VersionInfo | None = None, *, unique_versions: bool = False) -> None:
        self.fleet = fleet
        self.store = store
        self.unique_versions = unique_versions
        """Refuse a version string that was committed before."""
        self.version = version or VersionInfo(version=DEFAULT_VERSION)
        """The committed version (KV holds it durably)."""
        self.session: S.SessionState = S.Idle()
        self.state_lost = False
        """The durable state was lost: the committed version is unknown until a push commits."""
        self._kv_session: str | None = None
        """The open session KV records."""

    def routes(self, r: Routes) -> None:
        r.add(InitWeightTransfer, self.init_weight_transfer)
        r.add(StartWeightUpdate, self.start_weight_update)
        r.add(UpdateWeights, self.update_weights)
        r.add(FinishWeightUpdate, self.finish_weight_update)
        r.add(AbortWeightUpdate, self.abort_weight_update)
        r.add(UpdateWeightVersion, self.update_weight_version)
        r.add(GetWeightVersion, self.get_weight_version, read=True)

    @property
    def session_id(self) -> str | None:
        return getattr(self.session, "session_id", None)

    def ack(self, out: Outcome) -> FleetAck:
        return self.fleet.ack(out, session_id=self.session_id, weight_version=self.version.version)

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
        sid = self.session_id or ""
        step = self._advance(event)
        await self._settle(step.state)
        if step.abort_workers:
            await self._abort_everywhere(sid, reason)
        return step

    async def _settle(self, state: S.SessionState) -> None:
        """Move to `state` and keep KV's record of the open session in step with it. Compared
        with what KV holds, not with the previous in-memory state: finish and its failure
        paths step through Committing/Failed in memory before settling here."""
        self.session = state
        sid = self.session_id
        if sid != self._kv_session:
            await self.store.put_session(sid)
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

    async def _abort_everywhere(self, sid: str, reason: str) -> None:
        ids = self.fleet.registry.ids()
        if ids:
            await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=sid, reason=reason), ids)
        await self.fleet.event("session_aborted", ids, reason, session_id=sid or None)

    async def abort_on_loss(self, worker_id: str) -> None:
        async with self.fleet.lock:
            if isinstance(self.session, S.Open):  # Committing is resolved by finish itself
                await self._apply(S.WorkerLost(worker_id), f"worker {worker_id} left during the session")

    async def abort_orphan(self, worker_id: str, session_id: str) -> None:
        """Drop a session a worker holds that this controller does not (from before a restart)."""
        async with self.fleet.lock:
            if session_id != self.session_id:
                await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=session_id, reason="orphaned session"),
                                      [worker_id])

    # ---- handlers ----------------------------------------------------------------------

    async def init_weight_transfer(self, cmd: InitWeightTransfer) -> FleetAck:
        init = cmd.init_info
        registry = self.fleet.registry
        async with self.fleet.lock:
            if not isinstance(self.session, S.Idle):
                raise FailedPrecondition(f"session {self.session_id} is open; finish or abort it first")
            workers = self.fleet.ids()
            backends = {w: registry.capabilities(w).weight_transfer_backend for w in workers}
            missing = [w for w, b in backends.items() if b is None]
            if missing:
                raise refuse(f"workers {missing} have no weight transfer backend; start them with --weight-transfer-backend",
                             dict.fromkeys(missing, "no weight transfer backend"))
            if len(set(backends.values())) > 1:
                raise refuse(f"workers disagree on the transfer backend: {backends}",
                             {w: f"backend {b}" for w, b in backends.items()})
            fleet_backend = next(iter(backends.values()))
            wanted = cmd.backend or init.backend
            if wanted != fleet_backend or init.backend != fleet_backend:
                raise FailedPrecondition(f"the fleet's backend is {fleet_backend}, not {wanted}")
            if init.world_size != len(workers) + init.rank_offset:
                raise FailedPrecondition(
                    f"world_size {init.world_size} does not match the fleet: {len(workers)} workers + "
                    f"rank_offset {init.rank_offset}; read server_info() again and retry"
                )
            ranks = {w: init.rank_offset + i for i, w in enumerate(workers)}
            timeout = max(self.fleet.command_timeout_s, init.timeout_s + 5)
            out = await self.fleet.send(
                lambda w, epoch, cid: InitWeightTransferWorker(epoch=epoch, command_id=cid, init_info=init, rank=ranks[w]),
                workers, timeout=timeout
            )
            out.raise_for_failures("init_weight_transfer")
            return self.ack(out)

    async def start_weight_update(self, cmd: StartWeightUpdate) -> FleetAck:
        target = cmd.target
        registry = self.fleet.registry
        async with self.fleet.lock:
            workers = self.fleet.ids()
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
            serving = [w for w in workers if registry.capabilities(w).update_mode == "in_place" and not registry.state(w).paused]
            if serving:
                raise refuse(
                    f"workers {serving} update in place (bytes land in the live weights) and are not paused; "
                    "pause first (push_weights does), so nothing uncommitted is served",
                    dict.fromkeys(serving, "updates in place and is not paused"),
                )
            sid = uuid.uuid4().hex[:16]
            step = self._advance(S.Start(session_id=sid, target=target, epoch=self.fleet.epoch))
            try:
                out = await self.fleet.send(
                    stamped(StartWeightUpdateWorker, target=target, session_id=sid, base_seq=cmd.base_seq), workers)
            except BaseException:  # the caller's deadline passed: close what opened
                with anyio.CancelScope(shield=True):
                    await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=sid, reason="start ran out of time"),
                                          workers)
                raise
            if not out.ok:
                await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=sid, reason="start failed"),
                                      list(out.acks))
                out.raise_for_failures(f"start_weight_update({target})")
            await self._settle(step.state)
        await self.fleet.event("session_started", workers, target, session_id=sid)
        return self.ack(out)

    async def update_weights(self, cmd: UpdateWeights) -> FleetAck:
        async with self.fleet.lock:
            step = self._advance(S.Update(session_id=cmd.session_id or None))
            elsewhere = {w: self.fleet.registry.state(w).transfer_group for w in self.fleet.ids()}
            elsewhere = {w: g for w, g in elsewhere.items() if g != cmd.group}
            if cmd.group and elsewhere:
                raise refuse(
                    f"workers {sorted(elsewhere)} are not in transfer group {cmd.group!r} (another trainer's "
                    "init_weight_transfer, or they left it): no byte would reach them; call init_weight_transfer() again",
                    {w: f"in transfer group {g!r}" for w, g in elsewhere.items()},
                )
            sid = self.session_id or ""
            workers = self.fleet.ids()

            def receive(check_only: bool):  # noqa: ANN202
                return stamped(UpdateWeightsWorker, session_id=sid, params=cmd.params, buckets=cmd.buckets,
                               check_only=check_only)

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
            if cmd.weight_version is not None:
                await self._refuse_a_used_version(cmd.weight_version)
            committing = (await self._apply(S.Finish(version=cmd.weight_version, session_id=cmd.session_id or None), "")).state
            if not isinstance(committing, S.Committing):
                raise error_for("INTERNAL", f"finish stepped to {type(committing).__name__}, not Committing")
            sid = committing.session_id
            workers = self.fleet.ids()
            try:
                prepared = await self.fleet.send(
                    stamped(PrepareWorker, session_id=sid, checksums=cmd.checksums, tensor_checksums=cmd.tensor_checksums),
                    workers
                )
            except BaseException:  # the caller's deadline passed: the session cannot stay Committing
                with anyio.CancelScope(shield=True):
                    await self._apply(S.Failed(reason="finish ran out of time"), "finish ran out of time in prepare")
                raise
            if not prepared.ok:
                err = prepared.error("finish_weight_update (prepare)")
                await self._apply(S.Failed(reason=err.message), err.message)
                raise err
            version = committing.version
            main = committing.target == "main"
            seq = (self.version.seq if main else self.version.draft_seq) + 1
            with anyio.CancelScope(shield=True):  # once workers commit, the commit completes (each worker is bounded)
                committed = await self.fleet.send(stamped(CommitWorker, session_id=sid, weight_version=version, seq=seq),
                                                  workers)
                return await self._committed(committing, committed, version, seq, workers)

    async def _committed(self, committing: S.Committing, committed: Outcome, version: str | None, seq: int,
                         workers: list[str]) -> FleetAck:
        """Phase 2 answered: record the commit (or abort what failed). Runs shielded, under the lock."""
        sid = committing.session_id
        main = committing.target == "main"
        if not committed.ok:
            # prepared workers that did commit keep the new weights (their session is closed,
            # so the abort passes them by); the durable version stays
            err = committed.error("finish_weight_update (commit)")
            await self._apply(S.Failed(reason=err.message), err.message)
            raise err
        done = self._advance(S.CommitDone())
        if main:
            new = msgspec.structs.replace(
                self.version, version=version or self.version.version, seq=seq,
                epoch=self.fleet.epoch, session_id=sid, workers=len(workers), time=time.time(),
            )
        else:
            new = msgspec.structs.replace(
                self.version, draft_version=version or self.version.draft_version, draft_seq=seq,
                epoch=self.fleet.epoch, session_id=sid, workers=len(workers), time=time.time(),
            )
        await self._commit_version(new)  # durable before KV forgets the session
        self.state_lost = False
        await self._settle(done.state)
        await self.fleet.event("session_committed", workers, new.version, session_id=sid)
        return self.ack(committed)

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

    async def _commit_version(self, info: VersionInfo) -> None:
        """Durable first (KV), then the event: a subscriber never sees a version KV lacks."""
        if self.unique_versions:
            await self.store.put_committed(info.version, info.seq)
        await self.store.put_version(info)
        self.version = info
        await self.fleet.nc.publish(self.fleet.subjects.version, encode(info))

    async def abort_weight_update(self, cmd: AbortWeightUpdate) -> FleetAck:
        reason = cmd.reason or "aborted by the trainer"
        async with self.fleet.lock:
            sid = self.session_id
            step = self._advance(S.Abort(session_id=cmd.session_id or None))
            workers = self.fleet.ids()
            await self._settle(step.state)
            # abort_workers when a session was open; with none open the trainer's abort still
            # sweeps any session a worker holds (e.g. one a crashed controller left)
            out = await self.fleet.send(stamped(AbortWeightUpdateWorker, session_id=sid or "", reason=reason), workers)
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
            self._advance(S.VersionSet())
            await self._refuse_a_used_version(cmd.new_version)
            workers = self.fleet.ids()
            seq = self.version.seq + 1
            out = await self.fleet.send(stamped(UpdateWeightVersionWorker, new_version=cmd.new_version, seq=seq),
                                        workers)
            out.raise_for_failures("update_weight_version")
            await self._commit_version(
                msgspec.structs.replace(
                    self.version, version=cmd.new_version, seq=seq, epoch=self.fleet.epoch, session_id=None,
                    workers=len(workers), time=time.time(),
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
                "workers disagree on the weight version: " + "; ".join(f"{v}: {ws}" for v, ws in groups.items())
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
