"""One leading controller per prefix: a lease in the state KV, renewed with revision checks.

A second controller waits in standby until the lease lapses (the leader died or stopped),
then takes it with a compare-and-set and a new, higher epoch. A leader that finds its lease
taken (it was paused past the lease, say) steps down: workers would refuse its old epoch anyway.
It believes a record that names another holder only above its own last acknowledged revision: after
a partition heals, an old stream leader may answer first with the record it last had.
Every state-changing command confirms the lease first (`confirm`): a leader cut off from the state
store's quorum (a partition, nodes down) can renew nothing, so it acts on nothing, while a standby
on the majority side takes the lapsed lease. A command whose own claim just reached the quorum
needs no renewal while the last one is under half a lease old (no other controller may take the
lease before it is a whole lease old; the keeper renews every quarter).
"""

from __future__ import annotations

import logging
import time

import anyio
import msgspec
from rlbus.schemas import KvKey, Unavailable

from .store import StateStore, is_wrong_sequence

log = logging.getLogger("rlbus.controller.lease")

KEY = KvKey.LEADER


class LeaseRecord(msgspec.Struct, frozen=True):
    controller_id: str
    renewed_at: float
    """Wall-clock seconds; a record older than the lease is up for grabs."""


_decoder = msgspec.json.Decoder(LeaseRecord)


class LeaseLost(Exception):
    """Another controller holds the lease now."""


class Lease:
    def __init__(self, store: StateStore, controller_id: str, lease_s: float = 5.0) -> None:
        self.store = store
        self.controller_id = controller_id
        self.lease_s = lease_s
        self._revision = 0
        self._renewing = anyio.Lock()
        self._settled: tuple[float, Exception | None] = (float("-inf"), None)
        """The last renewal: when it was sent (monotonic) and how it ended."""
        self._renewed = float("-inf")
        """When the last renewal that succeeded was sent (monotonic): its record says this
        controller holds the lease, and no other may take it until `lease_s` after it."""

    async def _read(self) -> tuple[LeaseRecord | None, int]:
        value, rev = await self.store.get(KEY)
        if not value:  # absent or deleted
            return None, rev
        return _decoder.decode(value), rev

    def _record(self) -> bytes:
        return msgspec.json.encode(LeaseRecord(self.controller_id, time.time()))

    async def try_acquire(self) -> LeaseRecord | None:
        """Take the lease if free or lapsed; None on success, else the current holder."""
        sent = time.monotonic()
        held, rev = await self._read()
        if (
            held is not None
            and held.controller_id != self.controller_id
            and time.time() - held.renewed_at <= self.lease_s
        ):
            return held
        try:
            if rev:
                self._revision = await self.store.update(KEY, self._record(), rev)
            else:
                self._revision = await self.store.put(KEY, self._record())
        except Exception as e:  # lost a race for it
            log.debug("lease race lost: %s", e)
            return (await self._read())[0] or LeaseRecord("unknown", time.time())
        self._settled = (sent, None)
        return None

    async def acquire(self, on_standby=None) -> None:
        """Wait until this controller holds the lease."""
        announced = False
        while True:
            try:
                holder = await self.try_acquire()
            except Unavailable as e:  # the store has no quorum here (a partition): nobody can take it now
                log.warning("standby: the lease cannot be read: %s", e)
                await anyio.sleep(self.lease_s / 4)
                continue
            if holder is None:
                return
            if not announced:
                log.warning(
                    "standby: controller %s leads; waiting for its lease (%.0fs) to lapse",
                    holder.controller_id,
                    self.lease_s,
                )
                if on_standby is not None:
                    on_standby(holder)
                announced = True
            await anyio.sleep(self.lease_s / 4)

    async def renew(self) -> None:
        """Renew the lease (a compare-and-set in the state store); raise LeaseLost if another
        controller took it, Unavailable if the store cannot take a write (no quorum)."""
        async with self._renewing:  # the keeper and confirm() share one revision
            await self._renew()

    async def _renew(self) -> None:
        sent = time.monotonic()
        try:
            await self._update_own()
        except Exception as e:
            self._settled = (sent, e)
            raise
        self._settled = (sent, None)
        self._renewed = sent

    async def _update_own(self) -> None:
        revision = self._revision
        deadline = time.monotonic() + self.store.patience_s
        doubted_until: float | None = None  # stale answers are doubted for one patience
        while True:
            try:
                self._revision = await self.store.update(KEY, self._record(), revision)
                return
            except Exception as e:
                if not is_wrong_sequence(e):
                    raise  # no quorum, NATS away: nothing says another controller holds it
                held, revision = await self._read()
                if held is None or held.controller_id != self.controller_id:
                    if revision > self._revision or (doubted_until is not None and time.monotonic() > doubted_until):
                        raise LeaseLost(f"lease taken by {held.controller_id if held else 'nobody'}") from e
                    # another holder at or below our own acknowledged write: a stale answer, not
                    # the store's state. A stream leader cut off by a partition that has not yet
                    # heard of its successor still answers, and the first answer wins: it refuses
                    # our revision and returns the record it last had. Revisions only grow, so a
                    # record that took the lease from us sits above ours. Past the patience the
                    # store is believed (its bucket was recreated, revisions restarting)
                    if doubted_until is None:
                        doubted_until = time.monotonic() + self.store.patience_s
                        log.info(
                            "lease renewal: a stale answer (%s at revision %d, ours %d); asking again",
                            held.controller_id if held else "nobody",
                            revision,
                            self._revision,
                        )
                    revision = self._revision
                    deadline = max(deadline, doubted_until)
            # still ours under another revision: a write retried after a timeout had landed, a
            # replica behind answered the read, the bucket was recreated with our record, or a
            # leader without quorum counts writes it cannot commit. Nobody else holds it: renew
            # from what the store says, within the store's patience
            if time.monotonic() > deadline:
                raise Unavailable(self.store.no_quorum("renew the lease", "the lease record's revision keeps moving"))
            await anyio.sleep(0.1)  # back-off between retries, not a wait for a condition

    def proven(self) -> bool:
        """The lease is provably this controller's now, without a round trip: a renewal that
        succeeded was sent less than half a lease ago (the keeper renews every quarter), and no
        other controller may take a record before it is a whole lease old."""
        return time.monotonic() - self._renewed < self.lease_s / 2

    async def confirm(self, quorum_proven: bool = False) -> None:
        """Before a state-changing command: renew now. A controller whose state store has no
        quorum (a partition, nodes down) or whose lease another took acts on nothing. Commands
        that arrive together share one renewal (one sent after they all asked).

        `quorum_proven`: the command's own write just reached the store's quorum (its claim in
        the answer store): then a lease its expiry proves (`proven`) needs no renewal."""
        if quorum_proven and self.proven():
            return
        asked = time.monotonic()
        async with self._renewing:
            sent, error = self._settled
            if sent >= asked:
                if error is not None:
                    raise error
                return
            await self._renew()

    def fresh(self) -> bool:
        """Whether this controller's own clock proves it still leads: its last renewal was
        confirmed and was sent less than a lease ago (no standby can have taken it since)."""
        sent, error = self._settled
        return error is None and time.monotonic() - sent < self.lease_s

    async def keep(self) -> None:
        """Renew every lease/4 until cancelled; raises LeaseLost."""
        while True:
            await anyio.sleep(self.lease_s / 4)
            try:
                await self.renew()
            except LeaseLost:
                raise
            except Exception as e:  # NATS briefly away: keep trying within the lease
                log.warning("lease renewal failed: %s", e)

    async def reclaim(self) -> None:
        """Write this leader's record into a recreated bucket (the state store was lost)."""
        sent = time.monotonic()
        self._revision = await self.store.create(KEY, self._record())
        self._settled = (sent, None)

    async def release(self) -> None:
        held, rev = await self._read()
        if held is not None and held.controller_id == self.controller_id:
            try:
                await self.store.delete(KEY, rev)
            except Exception as e:  # someone else holds it now: nothing to release
                log.debug("lease release skipped: %s", e)
