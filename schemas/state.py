"""What a worker is and what state it is in; carried by handshakes and replies."""

from __future__ import annotations

from typing import Literal

import msgspec

PauseMode = Literal["abort", "wait", "keep"]
SleepTag = Literal["weights", "kv_cache"]
SLEEP_TAGS: tuple[SleepTag, ...] = ("weights", "kv_cache")
Backend = Literal["nccl", "gloo", "shm"]
UpdateMode = Literal["staged", "in_place"]
UpdateTarget = Literal["main", "draft"]
DEFAULT_VERSION = "default"
MAX_VERSION_LEN = 128


def version_problem(version: str) -> str | None:
    """Why a weight-version string is not acceptable, or None when it is."""
    if not version or not version.strip():
        return "a weight version must not be empty"
    if len(version) > MAX_VERSION_LEN:
        return f"a weight version is at most {MAX_VERSION_LEN} characters, got {len(version)}"
    if not version.isprintable():
        return f"a weight version must be printable characters only, got {version!r}"
    return None


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker can do, from its ready handshake. AND-aggregated across the fleet."""

    sleep_mode_enabled: bool = False
    weight_transfer_backend: Backend | None = None
    """The transfer backend the worker was started with; None = cannot receive weights."""
    has_draft_model: bool = False
    supports_draft_weight_updates: bool = False
    model_name: str = ""
    num_params: int = 0
    """Parameters of the main model."""
    update_mode: UpdateMode = "staged"
    transfer_ranks: int = 1
    """Ranks the worker takes in a weight-transfer group, consecutive from the one it is given: its
    processes that receive bytes (a vLLM worker: one per tensor-parallel rank). Per worker, not
    aggregated."""


class FleetState(msgspec.Struct, frozen=True, kw_only=True):
    """What the trainer asked the fleet to be. The controller keeps it in KV and brings every
    worker to it before counting it in acks or letting it take generation traffic: a worker
    that joins, rejoins after a silence, or outlives a controller restart is reconciled."""

    paused: bool = False
    pause_mode: PauseMode | None = None
    paused_since: float | None = None
    """Wall-clock seconds when the fleet was paused (a pause nobody releases shows its age)."""
    sleep_level: int = 0
    sleeping_tags: list[SleepTag] = []
    """Parts asleep; empty = awake."""


class WorkerState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A worker's state as it reports it after every command. A field at its default is left out
    of the JSON (a decoder fills it in): an ack of 64 workers is half the bytes."""

    worker_id: str
    paused: bool = False
    pause_mode: PauseMode | None = None
    sleeping_tags: list[SleepTag] = []
    """Parts that are asleep; empty when fully awake."""
    sleep_level: int = 0
    weights_loaded: bool = True
    """False after a level-2 sleep until new weights arrive."""
    in_flight: int = 0
    """Generation requests running or frozen (keep mode)."""
    waiting: int = 0
    """Generation requests queued behind a pause or a sleep."""
    epoch: int = 0
    """The highest controller epoch it obeyed (its fence); 0 = never commanded."""
    controller_id: str = ""
    """The controller that last synced it: with `epoch`, who it answers to."""
    weight_version: str = DEFAULT_VERSION
    weight_seq: int = 0
    """Commit sequence of the weights it holds (VersionInfo.seq)."""
    draft_version: str | None = None
    draft_seq: int = 0
    """Commit sequence of the draft weights it holds (VersionInfo.draft_seq); 0 until it took a draft commit."""
    param_bytes: int = 0
    """Bytes of parameter storage resident in the engine (0 when weights sleep)."""
    kv_cache_bytes: int = 0
    """Bytes of KV cache resident in the engine (0 when the cache sleeps)."""
    dirty: bool = False
    """in_place mode: an aborted update left weights half-written; generation refused."""
    session_id: str | None = None
    """The open weight-update session, if any."""
    transfer_ready: bool = False
    """The worker has joined a weight-transfer group."""
    transfer_group: str | None = None
    """Which one (TransferInit.group_name)."""
    withheld: bool = False
    """Withheld from rl.generate: it joined on an older version than the committed one and
    takes no generation traffic until it has received current weights."""
    draft_stale: bool = False
    """The verifier was updated after the draft last was (speculation acceptance drops)."""
    spec_proposed: int = 0
    """Draft tokens proposed since the worker started."""
    spec_accepted: int = 0
    """Draft tokens accepted since the worker started."""

    @property
    def acceptance_rate(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def sleeping(self) -> bool:
        return bool(self.sleeping_tags)


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One registry entry as the controller reports it."""

    worker_id: str
    capabilities: Capabilities
    state: WorkerState
    rank: int
    """Stable order of the worker in the fleet (weight-transfer rank = rank_offset + rank)."""
    last_seen_s: float = 0.0
    """Seconds since the controller last heard from the worker."""
    behind: bool = False
    """Holds a version other than the committed one (the controller's view of its last report)."""
    quarantined: bool = False
    """It failed or missed a decided commit: withheld from generation until it holds exactly the
    committed bits (the next push, or a repair)."""
