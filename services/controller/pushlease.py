"""The fleet's push lease: one trainer at a time updates weights.

The first trainer's init_weight_transfer or start_weight_update takes it; every command that
trainer sends renews it (reads too, in memory; the session commands also in the state store);
its finish or abort releases it. It lapses `lease_s` after its holder's last command, so a dead
trainer blocks the fleet at most that long: the next trainer's claim then aborts the session
the dead one left open. Any other trainer's session command is refused at once with
FAILED_PRECONDITION naming the holder, before anything is dispatched (it never moves the
workers' transfer group). Trainers are told apart by ControlCommand.trainer_id (the SDK sends
one per client); every sender without one counts as one anonymous trainer.

A controller that takes over reads the lease from the store and grants its holder a full
period from then (renewals it only held in memory are not lost to the holder).
"""

from __future__ import annotations

import logging
import time

from rlbus.schemas import FailedPrecondition, PushLease

from .store import StateStore

log = logging.getLogger("rlbus.controller.pushlease")

PUSH_LEASE_S = 60.0
"""Default: a push whose bytes take longer than this between two commands must renew it (any
command of the trainer does, e.g. server_info)."""


class PushLeases:
    def __init__(self, store: StateStore, lease_s: float = PUSH_LEASE_S) -> None:
        self.store = store
        self.lease_s = lease_s
        self.held: PushLease | None = None
        """The lease as last granted (it may have lapsed: see `live`)."""
        self._groups: dict[str | None, str] = {}
        """The transfer group each trainer's last init_weight_transfer built (this controller's run)."""

    async def load(self) -> None:
        """After a takeover: the lease in the store, renewed from now."""
        held = await self.store.push_lease()
        self.held = (
            None
            if held is None
            else PushLease(trainer_id=held.trainer_id, renewed_at=time.time(), lease_s=self.lease_s, group=held.group)
        )
        if held is not None and held.group is not None:
            self._groups[held.trainer_id] = held.group

    def live(self) -> PushLease | None:
        """The holder, while its lease has not lapsed."""
        h = self.held
        return h if h is not None and time.time() - h.renewed_at <= h.lease_s else None

    def lapsed(self) -> PushLease | None:
        """A lease whose holder stopped renewing it (its session, if open, is abandoned)."""
        h = self.held
        return h if h is not None and self.live() is None else None

    def refuse_others(self, trainer_id: str | None, what: str) -> None:
        """FAILED_PRECONDITION naming the holder when another trainer holds a live lease."""
        h = self.live()
        if h is not None and h.trainer_id != trainer_id:
            left = max(0.0, h.lease_s - (time.time() - h.renewed_at))
            raise FailedPrecondition(
                f"{what} refused: trainer {_name(h.trainer_id)} holds the fleet's push lease (one trainer pushes at a "
                f"time); retry after its finish or abort, or once its lease lapses ({left:.0f}s without a command)"
            )

    async def claim(self, trainer_id: str | None, group: str | None = None) -> None:
        """Take or renew the lease for `trainer_id` (the caller checked refuse_others), in the store."""
        self.grant(trainer_id, group)
        await self.persist()

    def grant(self, trainer_id: str | None, group: str | None = None) -> None:
        """claim() in memory only: the caller keeps it in the store (`persist`) before it answers."""
        kept = self.held.group if self.held is not None and self.held.trainer_id == trainer_id else None
        self.held = PushLease(trainer_id=trainer_id, renewed_at=time.time(), lease_s=self.lease_s, group=group or kept)
        if group is not None:
            self._groups[trainer_id] = group

    async def persist(self) -> None:
        """The lease as granted, in the store."""
        await self.store.put_push_lease(self.held)

    def touch(self, trainer_id: str | None) -> None:
        """Any command of the holder renews its lease (in memory)."""
        h = self.live()
        if h is not None and h.trainer_id == trainer_id:
            self.held = PushLease(trainer_id=h.trainer_id, renewed_at=time.time(), lease_s=h.lease_s, group=h.group)

    async def release(self, trainer_id: str | None, *, ahead: bool = False) -> None:
        """The holder's finish or abort: the lease is free (in memory at once; a store that
        cannot take the write leaves a record that lapses, and a successor renews it).
        `ahead`: the write goes out ahead of the command's reply and is acknowledged after it."""
        if self.held is not None and self.held.trainer_id == trainer_id:
            self.held = None
            try:
                await self.store.put_push_lease(None, ahead=ahead)
            except Exception as e:
                log.warning("the released push lease was not kept in the state store: %s", e)

    def group_of(self, trainer_id: str | None) -> str | None:
        """The transfer group `trainer_id` built last, if this controller saw it."""
        return self._groups.get(trainer_id)


def _name(trainer_id: str | None) -> str:
    return repr(trainer_id) if trainer_id is not None else "(anonymous: a client that sends no trainer_id)"
