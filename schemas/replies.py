"""Replies. A refusal is a typed Nack with a code; success is a typed reply."""

from __future__ import annotations

from typing import Literal, Union

import msgspec

from .base import Message
from .codes import ErrorCode
from .state import DEFAULT_VERSION, Capabilities, FleetState, UpdateTarget, WorkerInfo, WorkerState
from .tensors import BucketMeta, ParamMeta, TensorChecksum, TransferInit


class WorkerFailure(msgspec.Struct, frozen=True, kw_only=True):
    """Why one worker failed a fan-out, or stands in the way of a command (busy, asleep, lacking
    a capability): every refusal that concerns workers names each one here."""

    worker_id: str
    code: ErrorCode
    message: str


class Nack(Message, frozen=True, kw_only=True, tag="nack"):
    code: ErrorCode
    message: str
    """Says what went wrong and how to fix it."""
    failures: list[WorkerFailure] = []
    """Per-worker causes, when the refusal came from the fleet."""


class RepairOffer(msgspec.Struct, frozen=True, kw_only=True):
    """offer_weights: the group a repair peer hosts, and the plan of what it will send."""

    init: TransferInit
    params: list[ParamMeta]
    buckets: list[BucketMeta]


class WorkerAck(Message, frozen=True, kw_only=True, tag="worker_ack"):
    """A worker ran the command; its state afterwards."""

    state: WorkerState
    tensor_checksums: list[TensorChecksum] = []
    """hash_weights: the checksum of every tensor the worker serves, in name order."""
    live_checksum: str = ""
    """hash_weights: one hash of the model the engine computes with, in the engine's own names
    and layout (vLLM: its repacked, fused parameters in each of its worker processes); "" where
    the tensors above are the live ones. Comparable between replicas of one engine and model."""
    offer: RepairOffer | None = None
    """offer_weights: the group and the plan."""
    sent_checksums: list[str] = []
    """send_weights: each bucket's checksum, in the order sent."""


class FleetAck(Message, frozen=True, kw_only=True, tag="fleet_ack"):
    """Every worker ran the command; their states afterwards, in rank order."""

    workers: list[WorkerState]
    answer: bool | None = None
    """The fleet's answer to a question: is_paused (every worker paused), is_sleeping (any
    worker has a part asleep); None for other commands."""
    session_id: str | None = None
    weight_version: str | None = None
    epoch: int = 0
    quarantined: list[str] = []
    """Workers withheld from generation because they failed or missed a decided commit (a
    finish that committed names them here): they serve again once they hold the committed bits."""


class PushLease(Message, frozen=True, kw_only=True, tag="push_lease"):
    """The fleet's push lease: one trainer at a time updates weights. Taken by its
    init_weight_transfer or start_weight_update, renewed by every command it sends, released by
    its finish or abort; it lapses `expires_in_s` after its holder's last command."""

    trainer_id: str | None
    """ControlCommand.trainer_id of the holder (None: an anonymous trainer)."""
    renewed_at: float
    """Wall-clock seconds of the holder's last command."""
    lease_s: float
    """It lapses this long after renewed_at."""
    group: str | None = None
    """The transfer group its init_weight_transfer built, if it built one."""


class ServerInfo(Message, frozen=True, kw_only=True, tag="server_info"):
    workers: list[WorkerInfo]
    capabilities: Capabilities
    """AND-aggregated over workers; a backend counts only if every worker has the same one."""
    epoch: int = 0
    weight_version: str = DEFAULT_VERSION
    weight_seq: int = 0
    """Commit sequence of the committed version (VersionInfo.seq)."""
    draft_version: str | None = None
    session_id: str | None = None
    controller_id: str = ""
    desired: FleetState = FleetState()
    """The state every worker is reconciled to (paused, sleeping) as the trainer last set it."""
    repairing: dict[str, str] = {}
    """Workers being repaired now (behind the committed weights), each with the peer it gets them from."""
    repair_problem: str = ""
    """Why workers behind the committed weights are not being repaired (e.g. no healthy peer), if so."""
    quarantined: list[str] = []
    """Workers that failed or missed a decided commit, withheld until they hold the committed bits."""
    push_lease: PushLease | None = None
    """The trainer holding the push lease now, if any."""


class VersionInfo(Message, frozen=True, kw_only=True, tag="version"):
    """The committed weight version; also the body of every rl.version event."""

    version: str
    seq: int = 0
    """Commit sequence of `version`: one more with every commit of the main weights (or
    update_weight_version). Version strings are free-form; this orders them, so staleness is
    a subtraction (`current.seq - reply.weight_seq`)."""
    draft_version: str | None = None
    draft_seq: int = 0
    """The same for the draft model."""
    epoch: int = 0
    session_id: str | None = None
    workers: int = 0
    time: float = 0.0


class WorkerWeights(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker serves, as verify_weights found it."""

    worker_id: str
    weight_version: str
    weight_seq: int
    tensors: int
    """How many tensors it hashed."""
    digest: str
    """One hash over every (name, tensor checksum) pair: equal digests, equal bits."""
    differs: list[str] = []
    """Tensors that differ from the reference (first 20 names), or that it lacks or adds;
    `<live model>` when its live model differs from the other replicas' (live_digest)."""
    live_digest: str = ""
    """The engine's hash of its live model (WorkerAck.live_checksum); "" where not separate."""


class WeightCheck(Message, frozen=True, kw_only=True, tag="weight_check"):
    """verify_weights: does every worker serve the same bits (and the trainer's, when given)?"""

    ok: bool
    """Every worker matches the reference."""
    target: UpdateTarget
    reference: Literal["trainer", "replicas"]
    """trainer: compared with the checksums the trainer sent; replicas: with the digest most
    workers share (a tie: the first worker's, in rank order)."""
    mismatched: list[str] = []
    """Workers whose bits differ from the reference."""
    workers: list[WorkerWeights] = []
    seconds: float = 0.0
    """How long the slowest worker took to hash what it serves."""


class CommitDecision(Message, frozen=True, kw_only=True, tag="commit_decision"):
    """A finish's decided outcome, kept in the state store before any worker commits: from it on
    the commit stands (a controller that takes over finishes it), and a worker that failed or
    missed it is quarantined until it holds exactly these bits. The manifest (the trainer's
    checksums) lets a repair verify a copy of them."""

    session_id: str
    target: UpdateTarget
    weight_version: str | None
    """What finish asked (None: keep the version string), sent as is in every Commit."""
    seq: int
    """The commit sequence these bits take (of `target`); never reused."""
    committed: VersionInfo
    """The committed version once this commit is recorded (what the store and rl.version carry)."""
    workers: list[str]
    """Every worker asked to commit (all of them prepared)."""
    checksums: list[str] = []
    """The manifest: the xxh3-128 of every bucket sent (FinishWeightUpdate.checksums)."""
    tensor_checksums: list[TensorChecksum] = []
    """The manifest of a delta session: each resulting tensor's xxh3-128 (of those sent as
    deltas); every tensor's once `manifest_complete`."""
    manifest_complete: bool = False
    """`tensor_checksums` names every tensor of the committed weights: kept by the first repair
    after this commit (what every healthy holder served), so later repairs need no holder to hash."""
    published: bool = False
    """The version was recorded and published on rl.version; False: a successor finishes it."""
    quarantined: list[str] = []
    """Workers that failed or missed this commit (kept up to date as they come back)."""
    epoch: int = 0
    time: float = 0.0


AnyReply = Union[Nack, WorkerAck, FleetAck, ServerInfo, VersionInfo, WeightCheck]
