"""The leadership lease believes a record naming another holder only when it sits above its own
last acknowledged write. After a partition heals, the stream leader that was cut off may not yet
have heard of its successor: it still answers, first, refusing the real leader's revision and
returning the record it last had. Believing it made both controllers step down (each saw the
other named). Measured on a 3-node nats-server 2.15 cluster with the stream led from the node
cut off: the majority elected a new stream leader 9 s after the cut, and the cut-off node still
called itself the leader until 20 s. The store here is a dict with revisions, and a stale replica that answers first a
given number of times; no server."""

from __future__ import annotations

from typing import cast

import msgspec
import pytest
from nats.js.errors import KeyWrongLastSequenceError
from rlbus.schemas.errors import Unavailable
from rlbus.services.controller.leadership import Lease, LeaseLost, LeaseRecord
from rlbus.services.controller.store import StateStore


class StaleAnswers:
    """A KV key with revisions (a stream's sequence), and a stale stream leader that answers the
    next `stale` calls first: it refuses every update and reads `old`, the record it last had."""

    patience_s = 0.5

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.seq = 0
        self.revision = 0
        self.stale = 0
        self.old: tuple[bytes, int] = (b"", 0)

    def no_quorum(self, what: str, fault: str) -> str:
        return f"no quorum: {what} ({fault})"

    def _write(self, value: bytes) -> int:
        self.seq += 1
        self.value, self.revision = value, self.seq
        return self.seq

    async def get(self, key: str) -> tuple[bytes | None, int]:
        if self.stale:
            self.stale -= 1
            return self.old
        return self.value, self.revision

    async def put(self, key: str, value: bytes) -> int:
        return self._write(value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        if self.stale:
            self.stale -= 1
            raise KeyWrongLastSequenceError(description="wrong last sequence: stale leader")
        if last != self.revision:
            raise KeyWrongLastSequenceError(description=f"wrong last sequence: {self.revision}")
        return self._write(value)

    def holder(self) -> str:
        assert self.value is not None
        return msgspec.json.decode(self.value, type=LeaseRecord).controller_id


def record(controller_id: str, renewed_at: float) -> bytes:
    return msgspec.json.encode(LeaseRecord(controller_id, renewed_at))


async def taken_over() -> tuple[StaleAnswers, Lease]:
    """`old` led at revision 1; `new` took the lease (revision 2) while `old` was cut off."""
    store = StaleAnswers()
    store._write(record("old", 0.0))  # lapsed long ago
    new = Lease(cast(StateStore, store), "new", lease_s=2.0)
    assert await new.try_acquire() is None and store.holder() == "new"
    store.old = (record("old", 0.0), 1)
    return store, new


async def test_a_stale_answer_naming_the_old_holder_does_not_make_the_new_leader_step_down():
    store, new = await taken_over()
    store.stale = 2  # the update refused and the read answered by the old stream leader
    await new.renew()
    assert store.holder() == "new" and store.revision == 3 and new.fresh()


async def test_a_record_above_the_leaders_own_revision_takes_its_lease():
    store, new = await taken_over()
    store._write(record("third", 1e12))  # another controller took it since: revision 3
    with pytest.raises(LeaseLost, match="taken by third"):
        await new.renew()
    assert store.holder() == "third"


async def test_the_old_leader_steps_down_on_the_successors_record():
    store, new = await taken_over()
    old = Lease(cast(StateStore, store), "old", lease_s=2.0)
    old._revision = 1  # what it last wrote before it was cut off
    with pytest.raises(LeaseLost, match="taken by new"):
        await old.renew()
    assert store.holder() == "new"


async def test_a_stale_answer_that_never_ends_is_believed_after_the_stores_patience():
    """A bucket recreated under a running leader restarts its revisions: a record below the
    leader's own is then the store's state, and after one patience of the same answer it is
    believed rather than leaving a leader that can renew nothing."""
    store, new = await taken_over()
    store.stale = 10**6
    with pytest.raises(LeaseLost, match="taken by old"):
        await new.renew()


async def test_a_store_without_quorum_is_unavailable_not_a_lost_lease():
    store, new = await taken_over()

    async def no_quorum(key: str, value: bytes, last: int) -> int:
        raise Unavailable("no quorum: renew the lease")

    store.update = no_quorum  # type: ignore[method-assign]
    with pytest.raises(Unavailable):
        await new.renew()
    assert not new.fresh()
