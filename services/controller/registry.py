"""The worker registry: who is in the fleet, what each can do, when we last heard from it."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from rlbus.schemas import Capabilities, Unavailable, VersionInfo, WorkerInfo, WorkerState


@dataclass
class Entry:
    capabilities: Capabilities
    state: WorkerState
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def worker_id(self) -> str:
        return self.state.worker_id


class Registry:
    """Workers known from their ready handshake, kept alive by heartbeats and replies."""

    def __init__(self, liveness_timeout_s: float = 3.0) -> None:
        self.liveness_timeout_s = liveness_timeout_s
        self._entries: dict[str, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._entries

    def join(self, capabilities: Capabilities, state: WorkerState) -> bool:
        """Add or refresh a worker from its handshake; True when it is new."""
        new = state.worker_id not in self._entries
        self._entries[state.worker_id] = Entry(capabilities, state)
        return new

    def seen(self, state: WorkerState) -> bool:
        """Record a heartbeat or a reply; False when the worker is unknown (it must re-announce)."""
        entry = self._entries.get(state.worker_id)
        if entry is None:
            return False
        entry.state = state
        entry.last_seen = time.monotonic()
        return True

    def leave(self, worker_id: str) -> bool:
        return self._entries.pop(worker_id, None) is not None

    def expired(self, now: float | None = None) -> list[str]:
        """Workers silent for longer than the liveness timeout."""
        now = time.monotonic() if now is None else now
        return [w for w, e in self._entries.items() if now - e.last_seen > self.liveness_timeout_s]

    def ids(self) -> list[str]:
        """Worker ids in the fleet's stable order (sorted): index = transfer rank - rank_offset."""
        return sorted(self._entries)

    def get(self, worker_id: str) -> Entry | None:
        return self._entries.get(worker_id)

    def _entry(self, worker_id: str) -> Entry:
        entry = self._entries.get(worker_id)
        if entry is None:
            raise Unavailable(f"worker {worker_id} left the registry; retry")
        return entry

    def capabilities(self, worker_id: str) -> Capabilities:
        """A registered worker's capabilities; UNAVAILABLE once it left."""
        return self._entry(worker_id).capabilities

    def state(self, worker_id: str) -> WorkerState:
        """A registered worker's last reported state; UNAVAILABLE once it left."""
        return self._entry(worker_id).state

    def infos(self, committed: VersionInfo | None = None, quarantined: Collection[str] = ()) -> list[WorkerInfo]:
        """Every entry in rank order; `behind`: it does not hold exactly the committed (version, seq)."""
        now = time.monotonic()

        def behind(s: WorkerState) -> bool:
            return committed is not None and (s.weight_version, s.weight_seq) != (committed.version, committed.seq)

        return [
            WorkerInfo(
                worker_id=w,
                capabilities=self._entries[w].capabilities,
                state=self._entries[w].state,
                rank=i,
                last_seen_s=round(now - self._entries[w].last_seen, 3),
                behind=behind(self._entries[w].state),
                quarantined=w in quarantined,
            )
            for i, w in enumerate(self.ids())
        ]

    def transfer_ranks(self, workers: list[str], offset: int) -> tuple[dict[str, int], int]:
        """Each worker's first rank in a transfer group whose first worker rank is `offset` (in
        the order given, each taking as many consecutive ranks as it has receiving processes:
        Capabilities.transfer_ranks), and the group's world size."""
        ranks, nxt = {}, offset
        for w in workers:
            ranks[w] = nxt
            nxt += self.capabilities(w).transfer_ranks
        return ranks, nxt

    def aggregate(self) -> Capabilities:
        """Capabilities AND-aggregated; a shared value counts only if every worker has it."""
        caps = [e.capabilities for e in self._entries.values()]
        if not caps:
            return Capabilities()

        def same(values: list):
            return values[0] if all(v == values[0] for v in values) else None

        return Capabilities(
            sleep_mode_enabled=all(c.sleep_mode_enabled for c in caps),
            weight_transfer_backend=same([c.weight_transfer_backend for c in caps]),
            has_draft_model=all(c.has_draft_model for c in caps),
            supports_draft_weight_updates=all(c.supports_draft_weight_updates for c in caps),
            model_name=same([c.model_name for c in caps]) or "",
            num_params=same([c.num_params for c in caps]) or 0,
            update_mode="staged" if all(c.update_mode == "staged" for c in caps) else "in_place",
        )
