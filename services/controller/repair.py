"""The fleet heals itself: a worker behind the committed weights gets them from a healthy peer.

A worker is behind when the (version, seq) it reports for a target is not the committed one
(rejoined after a freeze, restarted, missed a commit, newly started). Without waiting for the
trainer's next push, the controller picks a healthy peer that holds exactly the committed bits
and, under the fleet's lock (no session, no commit while it runs):

1. takes the manifest: every healthy holder hashes what it serves (hash_weights); they must all
   agree, or nothing is sent (a peer with other bits is never a source);
2. the peer hosts rank 0 of a new group (offer_weights); every behind worker joins it and opens
   a dense repair session (withheld, it lands the bytes in its live weights);
3. metadata, then bytes (send_weights), bucket range by bucket range; every receiver hashes each
   tensor where it landed and checks it against the manifest (prepare);
4. the receivers commit exactly the committed version and seq, and leave the repair group.

A failure aborts the repair on every receiver (nothing unverified is ever served) and it is
retried from another peer with exponential backoff. Behind workers of one target repair in one
group. A trainer's command waits for a running repair (bounded by its timeout).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import anyio
import msgspec
from rlbus.schemas import (
    AbortWeightUpdateWorker,
    Backend,
    BucketMeta,
    CommitWorker,
    HashWeightsWorker,
    InitWeightTransferWorker,
    LeaveWeightTransferWorker,
    OfferWeightsWorker,
    ParamMeta,
    PrepareWorker,
    RLBusError,
    SendWeightsWorker,
    StartWeightUpdateWorker,
    TensorChecksum,
    TransferInit,
    Unavailable,
    UpdateTarget,
    UpdateWeightsWorker,
    encode,
)

from . import session as S
from .fleet import Fleet, stamped
from .updates import Updates

log = logging.getLogger("rlbus.controller.repair")
T = TypeVar("T")

META_LIMIT = 256 << 10
"""Metadata bytes per receive command (one NATS message each)."""
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Wait before retrying a worker whose repair failed: the n-th failure waits BACKOFF_S[n-1]."""


class RepairOptions(msgspec.Struct, frozen=True, kw_only=True):
    enabled: bool = True
    timeout_s: float = 120.0
    """One repair, start to commit (its group's rendezvous and every collective included)."""
    check_s: float = 1.0
    """How often the registry is checked for behind workers (a join or a commit checks at once)."""


@dataclass
class _Backoff:
    failures: int = 0
    next_at: float = 0.0
    last_source: str = ""


class Repairs:
    def __init__(self, fleet: Fleet, updates: Updates, options: RepairOptions | None = None) -> None:
        self.fleet = fleet
        self.updates = updates
        self.opts = options or RepairOptions()
        self.repairing: dict[str, str] = {}
        """Workers being repaired now, each with its source (server_info, rlbus status)."""
        self.problem = ""
        """Why behind workers wait (no healthy peer, ...); '' when none does."""
        self.phases: dict[str, float] = {}
        """The last repair's time per phase, seconds (manifest, group, bytes, verify, commit)."""
        self._backoff: dict[tuple[str, UpdateTarget], _Backoff] = {}
        self._wake = anyio.Event()

    def poke(self) -> None:
        """Look for behind workers now (a worker joined, a commit landed)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            with anyio.move_on_after(self.opts.check_s):
                await self._wake.wait()
            self._wake = anyio.Event()
            if not self.opts.enabled:
                continue
            for target in ("main", "draft"):
                try:
                    await self.repair_once(target)  # type: ignore[arg-type]
                except Exception:
                    log.exception("repair pass for %s failed", target)

    # ---- who is behind, who is healthy -------------------------------------------------

    def _committed(self, target: UpdateTarget) -> tuple[str | None, int]:
        v = self.updates.version
        return (v.version, v.seq) if target == "main" else (v.draft_version, v.draft_seq)

    def behind(self, target: UpdateTarget) -> list[str]:
        """Registered workers not on the committed `target` weights that a repair can bring there."""
        version, seq = self._committed(target)
        if seq == 0 or version is None or self.updates.state_lost:
            return []  # nothing committed yet (every worker starts on its own initial weights)
        reg = self.fleet.registry
        out = []
        for w in reg.ids():
            st, caps = reg.state(w), reg.capabilities(w)
            if caps.weight_transfer_backend is None or "weights" in st.sleeping_tags or st.session_id:
                continue
            if target == "main" and ((st.weight_version, st.weight_seq) != (version, seq) or st.dirty):
                out.append(w)
            elif (
                target == "draft"
                and caps.supports_draft_weight_updates
                and (st.draft_version, st.draft_seq) != (version, seq)
            ):
                out.append(w)
        return out

    def healthy(self, target: UpdateTarget, behind: list[str]) -> list[str]:
        """Workers that hold exactly the committed `target` weights and serve."""
        reg = self.fleet.registry
        return [
            w
            for w in reg.ids()
            if w not in behind
            and not reg.state(w).withheld
            and reg.capabilities(w).weight_transfer_backend is not None
            and "weights" not in reg.state(w).sleeping_tags
            and (target == "main" or reg.capabilities(w).has_draft_model)
        ]

    # ---- one repair ----------------------------------------------------------------------

    async def repair_once(self, target: UpdateTarget) -> bool:
        """Repair every behind worker whose backoff has passed, in one group; True if one ran."""
        if not self.behind(target):
            await self._set_problem(target, "")
            return False
        async with self.fleet.lock:
            if not isinstance(self.updates.session, S.Idle) or self.updates.leases.live() is not None:
                return False  # a trainer's push (its lease, its session) owns the fleet; the next pass looks again
            behind = self.behind(target)
            now = time.monotonic()
            due = [w for w in behind if self._backoff.get((w, target), _Backoff()).next_at <= now]
            if not due:
                return False
            sources = self.healthy(target, behind)
            backends = {self.fleet.registry.capabilities(w).weight_transfer_backend for w in [*due, *sources]}
            if len(backends) != 1:
                await self._set_problem(
                    target, f"workers disagree on the transfer backend ({sorted(map(str, backends))})"
                )
                return False
            if not sources:
                await self._set_problem(
                    target, f"no healthy peer holds the committed {target} weights; waiting for a push"
                )
                return False
            source = self._pick(sources, due, target)
            version, seq = self._committed(target)
            began = time.monotonic()
            for w in due:
                self.repairing[w] = source
            try:
                with anyio.fail_after(self.opts.timeout_s):
                    nbytes = await self._while_alive(
                        [source, *due], self._repair(source, sources, due, target, backends.pop())
                    )  # type: ignore[arg-type]
            except (RLBusError, TimeoutError) as e:
                why = e.message if isinstance(e, RLBusError) else f"timed out after {self.opts.timeout_s:g}s"
                for w in due:
                    b = self._backoff.setdefault((w, target), _Backoff())
                    b.failures += 1
                    b.last_source = source
                    b.next_at = time.monotonic() + BACKOFF_S[min(b.failures, len(BACKOFF_S)) - 1]
                log.warning("repairing %s (%s) from %s failed: %s", due, target, source, why)
                await self.fleet.event("repair_failed", due, f"{target} from {source}: {why}")
                return True
            finally:
                for w in due:
                    self.repairing.pop(w, None)
            for w in due:
                self._backoff.pop((w, target), None)
            seconds = time.monotonic() - began
            await self._set_problem(target, "")
            log.info(
                "repaired %s (%s, %s seq %d) from %s: %d bytes in %.2fs",
                due,
                target,
                version,
                seq,
                source,
                nbytes,
                seconds,
            )
            await self.fleet.event(
                "worker_repaired",
                due,
                f"source={source} target={target} version={version} seq={seq} bytes={nbytes} seconds={seconds:.3f} "
                f"phases={','.join(f'{k}:{v:.3f}' for k, v in self.phases.items())}",
            )
            return True

    def _pick(self, sources: list[str], due: list[str], target: UpdateTarget) -> str:
        """A peer other than the one that failed these workers last, when there is one."""
        failed = {self._backoff[(w, target)].last_source for w in due if (w, target) in self._backoff}
        fresh = [s for s in sources if s not in failed]
        return (fresh or sources)[0]

    async def _set_problem(self, target: UpdateTarget, problem: str) -> None:
        if problem and problem != self.problem:
            await self.fleet.event("repair_waiting", self.behind(target), problem)
        self.problem = problem

    async def _manifest(self, target: UpdateTarget, holders: list[str]) -> list[TensorChecksum]:
        """The tensor checksums the receivers verify against: the decided commit's manifest.
        A delta commit's decision names the checksums of the tensors it sent as deltas, a dense
        one's its buckets' only; so the first repair after a commit asks every healthy holder to
        hash what it serves, refuses unless they all agree (and agree with what the decision
        names), and keeps the agreed checksums with the decision (the lock is held: no commit
        races it). Later repairs take the kept manifest as it is: a source whose bits rotted
        since fails the receivers' check, and the repair is retried from another peer."""
        decision = self.updates.decision
        current = decision is not None and decision.target == target and decision.seq == self._committed(target)[1]
        if current and decision is not None and decision.manifest_complete:
            return decision.tensor_checksums
        out = await self.fleet.send(stamped(HashWeightsWorker, target=target), holders)
        out.raise_for_failures("repair (hashing the committed weights)")
        sums = {w: tuple((c.name, c.checksum) for c in a.tensor_checksums) for w, a in out.answers.items()}
        if len(set(sums.values())) != 1:
            raise Unavailable(
                f"the healthy workers {sorted(sums)} do not serve the same {target} bits; "
                "nothing is repaired from them (push weights, or run verify_weights)"
            )
        agreed = next(iter(out.answers.values())).tensor_checksums
        if not current or decision is None:
            return agreed  # decided before decisions were kept, or the other target's: the holders' word
        kept = {c.name: c.checksum for c in decision.tensor_checksums}
        differ = [c.name for c in agreed if c.name in kept and kept[c.name] != c.checksum]
        if differ:
            raise Unavailable(
                f"the healthy workers serve {target} bits other than the decided commit's manifest "
                f"({', '.join(differ[:5])}); nothing is repaired from them (push weights, or run verify_weights)"
            )
        self.updates.decision = msgspec.structs.replace(decision, tensor_checksums=list(agreed), manifest_complete=True)
        await self.updates.store.put_decision(self.updates.decision)
        return agreed

    async def _repair(
        self, source: str, holders: list[str], receivers: list[str], target: UpdateTarget, backend: Backend
    ) -> int:
        """One repair of `receivers` from `source` (the caller holds the lock); bytes sent."""
        version, seq = self._committed(target)
        clock = _Phases()
        self.phases = clock.seconds
        manifest = await self._manifest(target, holders)
        clock.mark("manifest")
        group = f"rlbus-repair-{uuid.uuid4().hex[:12]}"
        ranks, world_size = self.fleet.registry.transfer_ranks(receivers, 1)
        init = TransferInit(
            backend=backend,
            master_addr="",
            master_port=0,
            world_size=world_size,
            rank_offset=1,
            group_name=group,
            timeout_s=min(30.0, self.opts.timeout_s / 2),
        )
        sid = f"repair-{uuid.uuid4().hex[:12]}"
        opened = False
        try:
            offered = await self.fleet.send(stamped(OfferWeightsWorker, target=target, init_info=init), [source])
            offered.raise_for_failures(f"repair (offer from {source})")
            offer = offered.answers[source].offer
            assert offer is not None
            joined = await self.fleet.send(
                lambda w, epoch, cid: InitWeightTransferWorker(
                    epoch=epoch, command_id=cid, init_info=offer.init, rank=ranks[w]
                ),
                receivers,
                timeout=init.timeout_s + 5,
            )
            joined.raise_for_failures("repair (joining the peer's group)")
            (
                await self.fleet.send(
                    stamped(StartWeightUpdateWorker, session_id=sid, target=target, repair=True), receivers
                )
            ).raise_for_failures("repair (opening the session)")
            opened = True
            clock.mark("group")
            for params, buckets, first, last in chunks(offer.params, offer.buckets):
                got = await self.fleet.send(
                    stamped(UpdateWeightsWorker, session_id=sid, params=params, buckets=buckets), receivers
                )
                got.raise_for_failures("repair (metadata)")
                sent = await self.fleet.send(
                    stamped(SendWeightsWorker, group_name=group, first=first, last=last, checksums=False),
                    [source],
                    timeout=self.opts.timeout_s,
                )
                sent.raise_for_failures(f"repair (sending from {source})")
            clock.mark("bytes")
            prepared = await self.fleet.send(
                stamped(PrepareWorker, session_id=sid, tensor_checksums=manifest),
                receivers,  # by tensor only
            )
            prepared.raise_for_failures("repair (verifying against the manifest)")
            clock.mark("verify")
            committed = await self.fleet.send(
                stamped(CommitWorker, session_id=sid, weight_version=version, seq=seq), receivers
            )
            opened = False
            committed.raise_for_failures("repair (commit)")
            clock.mark("commit")
            await self.updates.review(committed.acks.values())  # quarantined by a decided commit: released
            return sum(b.nbytes for b in offer.buckets)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                if opened:
                    await self.fleet.send(
                        stamped(AbortWeightUpdateWorker, session_id=sid, reason="repair failed"), receivers
                    )
                await self.fleet.send(stamped(LeaveWeightTransferWorker, group_name=group), [*receivers, source])

    async def _while_alive(self, workers: list[str], call: Awaitable[T]) -> T:
        """`call`, given up as soon as one of `workers` leaves the registry (it died or froze:
        its heartbeats stopped), rather than at the repair's own deadline: a repair holds the
        fleet's lock, so a lost peer or receiver must not keep the trainer waiting."""
        result: list[T] = []
        gone: list[str] = []

        async def watch(scope: anyio.CancelScope) -> None:
            # the registry has no change event of its own: a cheap poll
            while all(w in self.fleet.registry for w in workers):  # noqa: ASYNC110
                await anyio.sleep(0.1)
            gone.extend(w for w in workers if w not in self.fleet.registry)
            scope.cancel()

        errors: list[Exception] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg.cancel_scope)
            try:
                result.append(await call)
            except Exception as e:
                errors.append(e)
            tg.cancel_scope.cancel()
        if errors:
            raise errors[0]
        if not result:
            raise Unavailable(f"{', '.join(gone)} left the fleet during the repair")
        return result[0]


def chunks(
    params: list[ParamMeta], buckets: list[BucketMeta]
) -> Iterator[tuple[list[ParamMeta], list[BucketMeta], int, int]]:
    """Consecutive bucket ranges whose metadata stays under META_LIMIT, rebased to start at 0
    (each receive command numbers its buckets 0..n-1): (params, buckets, first, last)."""
    per: list[list[ParamMeta]] = [[] for _ in buckets]
    for m in params:
        per[m.bucket].append(m)
    first, size = 0, 0
    for k in range(len(buckets) + 1):
        cost = 64 + sum(len(encode(m)) + 1 for m in per[k]) if k < len(buckets) else 0
        if k == len(buckets) or (k > first and size + cost > META_LIMIT):
            if k > first:
                yield (
                    [msgspec.structs.replace(m, bucket=m.bucket - first) for j in range(first, k) for m in per[j]],
                    [msgspec.structs.replace(b, index=b.index - first) for b in buckets[first:k]],
                    first,
                    k,
                )
            first, size = k, 0
        size += cost


class _Phases:
    """Seconds per phase of one repair, as they end (the worker_repaired event carries them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = now - self._last
        self._last = now
