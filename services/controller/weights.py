"""The controller's weight-update handlers: transfer groups, sessions, two-phase finish,
versions. A mixin of ControllerService (service.py), which holds the state, the lock, the
registry, the KV store and the fan-out these handlers use."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

import msgspec

from rlbus.errors import FailedPrecondition, InvalidArgument, error_for
from rlbus.schemas import (
    AbortWeightUpdate,
    AnyCommand,
    Commit,
    FinishWeightUpdate,
    FleetAck,
    GetStatus,
    GetWeightVersion,
    InitWeightTransfer,
    PrepareCommit,
    StartDraftWeightUpdate,
    StartWeightUpdate,
    UpdateTarget,
    UpdateWeights,
    UpdateWeightVersion,
    VersionInfo,
    checksums_problem,
    encode,
    version_problem,
)

from . import session as S

if TYPE_CHECKING:
    from .service import ControllerService as _Base
else:
    _Base = object


class WeightUpdateHandlers(_Base):
    # ---- weight updates ----------------------------------------------------------------

    def _session_id(self) -> str | None:
        return getattr(self.session, "session_id", None)

    def _advance(self, event: S.Event) -> S.Step:
        """Apply a session event; raise the refusal if the state machine refuses it."""
        out = S.step(self.session, event)
        if out.refusal is not None:
            raise error_for(out.refusal.code, out.refusal.message)
        return out

    async def _set_session(self, state: S.SessionState) -> None:
        """Move to `state` and keep KV's record of the open session in step with it. Compared
        with what KV holds, not with the previous in-memory state: finish and its failure
        paths step through Committing/Failed in memory before settling here."""
        self.session = state
        sid = self._session_id()
        if self.store is not None and sid != self._kv_session:
            await self.store.put_session(sid)
            self._kv_session = sid

    async def _abort_everywhere(self, reason: str, workers: list[str] | None = None) -> None:
        sid = self._session_id() or ""
        ids = self.registry.ids() if workers is None else workers
        if ids:
            await self._fan_out(AbortWeightUpdate(session_id=sid, reason=reason), ids)
        await self._set_session(S.Idle())
        await self._event("session_aborted", ids, reason, session_id=sid or None)

    async def _abort_on_loss(self, worker_id: str) -> None:
        async with self._lock:
            if isinstance(self.session, S.Open):  # Committing is resolved by finish itself
                self._advance(S.WorkerLost(worker_id))
                await self._abort_everywhere(f"worker {worker_id} left during the session")

    async def _abort_orphan(self, worker_id: str, session_id: str) -> None:
        async with self._lock:
            if session_id != self._session_id():
                await self._fan_out(AbortWeightUpdate(session_id=session_id, reason="orphaned session"), [worker_id])

    async def _init_weight_transfer(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, InitWeightTransfer)
        init = cmd.init_info
        if init is None:
            raise InvalidArgument("init_weight_transfer needs init_info: the rendezvous the trainer opened")
        async with self._lock:
            if not isinstance(self.session, S.Idle):
                raise FailedPrecondition(f"session {self._session_id()} is open; finish or abort it first")
            workers = self._workers()
            backends = {w: self.registry.get(w).capabilities.weight_transfer_backend for w in workers}  # type: ignore[union-attr]
            missing = [w for w, b in backends.items() if b is None]
            if missing:
                raise FailedPrecondition(f"workers {missing} have no weight transfer backend; start them with --weight-transfer-backend")
            if len(set(backends.values())) > 1:
                raise FailedPrecondition(f"workers disagree on the transfer backend: {backends}")
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
            timeout = max(self.opts.command_timeout_s, init.timeout_s + 5)
            out = await self._fan_out(lambda w: msgspec.structs.replace(cmd, rank=ranks[w]), workers, timeout=timeout)
            out.raise_for_failures("init_weight_transfer")
            return self._fleet(out)

    async def _start_weight_update(self, cmd: AnyCommand) -> FleetAck:
        target: UpdateTarget = "draft" if isinstance(cmd, StartDraftWeightUpdate) else getattr(cmd, "target", "main")
        async with self._lock:
            workers = self._workers()
            if target == "draft":
                caps = self.registry.aggregate()
                if not caps.supports_draft_weight_updates:
                    lacking = [w for w in workers if not self.registry.get(w).capabilities.supports_draft_weight_updates]  # type: ignore[union-attr]
                    raise FailedPrecondition(
                        f"workers {lacking} cannot update a draft model (no draft, speculation off, or the backend does not support it)"
                    )
            asleep = [w for w in workers if "weights" in self.registry.get(w).state.sleeping_tags]  # type: ignore[union-attr]
            if asleep:
                raise FailedPrecondition(
                    f"weights are asleep on {asleep}; call wake_up(tags=['weights']) first "
                    "(after a level-2 sleep: wake weights -> update -> wake kv_cache)"
                )
            sid = uuid.uuid4().hex[:16]
            step = self._advance(S.Start(session_id=sid, target=target, epoch=self.epoch))
            out = await self._fan_out(StartWeightUpdate(target=target, session_id=sid), workers)
            if not out.ok:
                await self._fan_out(AbortWeightUpdate(session_id=sid, reason="start failed"), list(out.acks))
                out.raise_for_failures(f"start_weight_update({target})")
            await self._set_session(step.state)
        await self._event("session_started", workers, target, session_id=sid)
        return self._fleet(out)

    async def _update_weights(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, UpdateWeights)
        async with self._lock:
            step = self._advance(S.Update(session_id=cmd.session_id or None))
            sid = self._session_id() or ""
            workers = self._workers()
            # every worker checks names, dtypes and shapes before any byte moves
            check = await self._fan_out(msgspec.structs.replace(cmd, session_id=sid, check_only=True), workers)
            check.raise_for_failures("update_weights (metadata check)")
            out = await self._fan_out(msgspec.structs.replace(cmd, session_id=sid, check_only=False), workers)
            if not out.ok:
                err = out.error("update_weights")
                self._advance(S.Failed(reason=str(err)))
                await self._abort_everywhere(err.message)
                raise err
            await self._set_session(step.state)
            return self._fleet(out)

    async def _finish_weight_update(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, FinishWeightUpdate)
        if cmd.weight_version is not None and (problem := version_problem(cmd.weight_version)):
            raise InvalidArgument(problem)
        if problem := checksums_problem(cmd.checksums):
            raise InvalidArgument(problem)
        async with self._lock:
            step = self._advance(S.Finish(version=cmd.weight_version, session_id=cmd.session_id or None))
            assert isinstance(step.state, S.Committing)
            committing = step.state
            self.session = committing
            sid = committing.session_id
            workers = self._workers()
            prepared = await self._fan_out(PrepareCommit(session_id=sid, checksums=cmd.checksums), workers)
            if not prepared.ok:
                err = prepared.error("finish_weight_update (prepare)")
                self.session = S.Open(sid, committing.target, committing.epoch)
                self._advance(S.Failed(reason=err.message))
                await self._abort_everywhere(err.message)
                raise err
            committed = await self._fan_out(Commit(session_id=sid, weight_version=cmd.weight_version), workers)
            if not committed.ok:
                # prepared workers that did commit keep the new weights; the durable version stays
                err = committed.error("finish_weight_update (commit)")
                self.session = self._advance(S.Failed(reason=err.message)).state
                await self._abort_everywhere(err.message, [f.worker_id for f in committed.failures])
                raise err
            self.session = self._advance(S.Committed()).state
            if committing.target == "main":
                new = msgspec.structs.replace(
                    self.version, version=cmd.weight_version or self.version.version,
                    epoch=self.epoch, session_id=sid, workers=len(workers), time=time.time(),
                )
            else:
                new = msgspec.structs.replace(
                    self.version, draft_version=cmd.weight_version or self.version.draft_version,
                    epoch=self.epoch, session_id=sid, workers=len(workers), time=time.time(),
                )
            await self._commit_version(new)
            await self._set_session(S.Idle())
        await self._event("session_committed", workers, new.version, session_id=sid)
        return self._fleet(committed)

    async def _commit_version(self, info: VersionInfo) -> None:
        """Durable first (KV), then the event: a subscriber never sees a version KV lacks."""
        assert self.store is not None
        await self.store.put_version(info)
        self.version = info
        await self.nc.publish(self.subjects.version, encode(info))

    async def _abort_weight_update(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, AbortWeightUpdate)
        async with self._lock:
            sid = self._session_id()
            self._advance(S.Abort(session_id=cmd.session_id or None))
            workers = self._workers()
            out = await self._fan_out(AbortWeightUpdate(session_id=sid or "", reason=cmd.reason or "aborted by the trainer"), workers)
            await self._set_session(S.Idle())
        if sid:
            await self._event("session_aborted", workers, cmd.reason or "aborted by the trainer", session_id=sid)
        return self._fleet(out)

    async def _update_weight_version(self, cmd: AnyCommand) -> FleetAck:
        assert isinstance(cmd, UpdateWeightVersion)
        if problem := version_problem(cmd.new_version):
            raise InvalidArgument(problem)
        async with self._lock:
            self._advance(S.SetVersion())
            workers = self._workers()
            out = await self._fan_out(cmd, workers)
            out.raise_for_failures("update_weight_version")
            await self._commit_version(
                msgspec.structs.replace(self.version, version=cmd.new_version, epoch=self.epoch, session_id=None, workers=len(workers), time=time.time())
            )
            return self._fleet(out)

    async def _get_weight_version(self, cmd: AnyCommand) -> VersionInfo:
        assert isinstance(cmd, GetWeightVersion)
        out = await self._fan_out(GetStatus(), self._workers())
        out.raise_for_failures("get_weight_version")
        seen = {w: st.weight_version for w, st in out.acks.items()}
        if len(set(seen.values())) != 1:
            groups: dict[str, list[str]] = {}
            for w, v in sorted(seen.items()):
                groups.setdefault(v, []).append(w)
            raise FailedPrecondition(
                "workers disagree on the weight version: " + "; ".join(f"{v}: {ws}" for v, ws in groups.items())
                + f" (committed: {self.version.version}); push weights again to bring them in step"
            )
        return msgspec.structs.replace(self.version, version=next(iter(seen.values())), workers=len(seen))
