"""The repair source: a healthy worker sends its committed weights to workers that are behind.

The controller picks a peer that holds exactly the committed weights and asks it to host rank
0 of a new transfer group (offer), lets the behind workers join it and open an ordinary update
session, then asks the peer to send (send). The peer reads its committed tensors while it keeps
serving: they change only at a commit, and no commit runs while the controller holds the
fleet's lock for the repair. The receivers stage, verify (against the commit's manifest) and
commit exactly as for a trainer's push.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
from rlbus.schemas import Aborted, Backend, FailedPrecondition, RepairOffer, TransferInit, UpdateTarget

from rlbus.transfer.base import TrainerTransfer, TransferError, detached
from rlbus.transfer.factory import trainer_transfer
from rlbus.transfer.stream import Plan, packs_every_bucket, prepare_for, scratch_bytes, scratch_pair, send_stream

from .engine import Engine

log = logging.getLogger("rlbus.worker.repair")

ADDRESS_ENV = "RLBUS_ADVERTISE_ADDR"
"""The address other workers reach this one at, for a repair group it hosts (default loopback:
set it on every worker host of a fleet that spans machines)."""
BUCKET_BYTES = 8 << 20
"""A repair's bucket size: every tensor of at least ``stream.solo_bytes`` (1 MiB over gloo's
sends, a quarter of a bucket over nccl's broadcasts) travels alone, sent from its
committed memory (no packing) and landed straight in the receiver's live parameter (a
withheld receiver lands in place); only the small ones are packed."""
MAX_TENSORS_PER_BUCKET = 512
"""Caps one shared bucket's tensors, so that its metadata fits one control message."""


class _Offer:
    def __init__(
        self, tx: TrainerTransfer, init: TransferInit, plan: Plan, named: list[tuple[str, torch.Tensor]]
    ) -> None:
        self.tx, self.init, self.plan, self.named = tx, init, plan, named
        self.opened = threading.Event()
        self.failure: BaseException | None = None
        self.scratch: list[torch.Tensor] | None = None


class RepairSource:
    """One per worker: at most one offered group at a time (one repair at a time per source)."""

    def __init__(self, engine: Engine, backend: Backend | None) -> None:
        self.engine = engine
        self.backend = backend
        self._offer: _Offer | None = None

    @property
    def busy(self) -> bool:
        return self._offer is not None

    def offer(self, target: UpdateTarget, init: TransferInit) -> RepairOffer:
        """Bind rank 0 of `init` (its rendezvous waits for the receivers in a thread) and plan
        the committed tensors. Returns at once."""
        if self.backend is None or init.backend != self.backend:
            raise FailedPrecondition(
                f"this worker's backend is {self.backend}, not {init.backend}: it cannot send a repair"
            )
        status = self.engine.status()
        if target == "main" and ("weights" in status.sleeping_tags or not status.weights_loaded):
            raise FailedPrecondition("its weights are asleep or discarded: it cannot be a repair source")
        self.close()
        named = sorted(self.engine.parameters_of(target).items())  # the committed bits, read in place
        tx = trainer_transfer(init.backend)
        plan = prepare_for(tx, named, BUCKET_BYTES, max_tensors=MAX_TENSORS_PER_BUCKET)
        addr = os.environ.get(ADDRESS_ENV) or init.master_addr or "127.0.0.1"
        try:
            bound = tx.bind(_with_addr(init, addr))
        except TransferError as e:
            tx.close()
            raise FailedPrecondition(f"could not host a repair group: {e}") from None
        offer = self._offer = _Offer(tx, bound, plan, named)

        def open_group() -> None:
            try:
                tx.open(bound)
            except BaseException as e:
                offer.failure = e
            offer.opened.set()

        threading.Thread(target=open_group, name="rlbus-repair-open", daemon=True).start()
        return RepairOffer(init=bound, params=plan.params, buckets=plan.buckets)

    @property
    def group_name(self) -> str | None:
        return self._offer.init.group_name if self._offer is not None else None

    async def send(self, group_name: str, first: int = 0, last: int | None = None, checksums: bool = True) -> list[str]:
        """Send buckets first..last-1 of the offered plan once the group formed; their
        checksums (none unless `checksums`: the receivers verify against the manifest). A
        failure closes the group."""
        offer = self._offer
        if offer is None or offer.init.group_name != group_name:
            raise FailedPrecondition(f"no repair group {group_name!r} is offered by this worker")

        def run() -> list[str]:
            if not offer.opened.wait(offer.init.timeout_s + 1):
                raise TransferError(
                    f"the receivers did not join repair group {group_name} in {offer.init.timeout_s:g}s"
                )
            if offer.failure is not None:
                raise TransferError(f"repair group {group_name} did not form: {offer.failure}")
            every = packs_every_bucket(offer.tx)
            if offer.scratch is None:
                offer.scratch = scratch_pair(offer.tx, scratch_bytes(offer.plan, offer.named, pack_every_bucket=every))
            return send_stream(
                offer.tx,
                offer.plan,
                offer.named,
                first=first,
                last=last,
                scratch=offer.scratch,
                pack_every_bucket=every,
                hash_buckets=checksums,
            )

        try:
            return await detached(run, name="rlbus-repair-send")
        except TransferError as e:
            self.close()
            raise Aborted(f"sending the repair failed: {e}") from None

    def close(self) -> None:
        """Drop the offered group at once (a rendezvous or send still running is abandoned)."""
        offer, self._offer = self._offer, None
        if offer is not None:
            offer.tx.close()


def _with_addr(init: TransferInit, addr: str) -> TransferInit:
    import msgspec

    return msgspec.structs.replace(init, master_addr=addr)
