"""Names on the bus. Every subject, KV bucket, KV key, stream, micro service and queue group
rlbus uses is spelled here and nowhere else."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

WorkerEventKind = Literal["ready", "heartbeat", "gone"]


def check_token(value: str, what: str) -> str:
    """Refuse a subject token that would change the subject's shape (dots, wildcards, spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must be letters, digits, '_' or '-' only")
    return value


class Subjects(msgspec.Struct, frozen=True):
    """All subjects under one prefix (default ``rl``)."""

    prefix: str = "rl"

    def __post_init__(self) -> None:
        for part in self.prefix.split("."):
            check_token(part, "subject prefix part")

    def control(self, op: str) -> str:
        """trainer -> controller, request/reply, one op per subject."""
        return f"{self.prefix}.control.{op}"

    def worker(self, worker_id: str, op: str) -> str:
        """controller -> one worker, request/reply."""
        return f"{self.prefix}.worker.{worker_id}.{op}"

    def worker_commands(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.*"

    def worker_event(self, worker_id: str, kind: WorkerEventKind) -> str:
        """worker -> controller: its handshake (`ready`), liveness beats (`heartbeat`) and goodbye
        (`gone`), under its own id, so a worker's credentials can be scoped to its own subjects."""
        return f"{self.prefix}.workers.{worker_id}.{kind}"

    def worker_events(self, kind: WorkerEventKind) -> str:
        """What the controller subscribes to: one kind of event from every worker."""
        return f"{self.prefix}.workers.*.{kind}"

    @staticmethod
    def worker_of_event(subject: str) -> str:
        """The worker id a worker-event subject names."""
        return subject.rsplit(".", 2)[-2]

    def inbox(self, identity: str) -> str:
        """The reply-inbox prefix of one identity ("trainer", "observer", "controller",
        "worker-<id>"): each may read replies to its own requests, not everyone's `_INBOX.>`."""
        return f"_INBOX.{self.prefix.replace('.', '-')}-{identity}"

    @property
    def controller_hello(self) -> str:
        """controller -> all workers: re-announce yourselves."""
        return f"{self.prefix}.controller.hello"

    @property
    def version(self) -> str:
        """controller -> anyone: a version was committed."""
        return f"{self.prefix}.version"

    def event(self, kind: str) -> str:
        """controller -> anyone: fleet state events."""
        return f"{self.prefix}.events.{kind}"

    @property
    def events(self) -> str:
        return f"{self.prefix}.events.>"

    @property
    def generate(self) -> str:
        """client -> workers (queue group): generation on the reference engine."""
        return f"{self.prefix}.generate"

    def generate_at(self, worker_id: str) -> str:
        """client -> one worker: a generate sent again to the worker that took it (its
        RESEND_TO_HEADER named this subject), answered from that run rather than by another."""
        return f"{self.prefix}.generate.{worker_id}"

    @property
    def control_group(self) -> str:
        """The micro endpoint group the controller serves control ops under."""
        return f"{self.prefix}.control"

    def worker_group(self, worker_id: str) -> str:
        """The micro endpoint group one worker serves its commands under."""
        return f"{self.prefix}.worker.{worker_id}"

    @property
    def generate_queue(self) -> str:
        """Queue group of rl.generate: each request goes to one worker."""
        return f"{self.prefix}-generate"

    @property
    def kv_bucket(self) -> str:
        """JetStream KV bucket holding durable controller state."""
        return f"{self.prefix.replace('.', '_')}_state"

    @property
    def replies_bucket(self) -> str:
        """JetStream KV bucket (with a TTL) holding the controller's answers to state-changing
        commands by command id, so a retry after a restart gets the first answer."""
        return f"{self.prefix.replace('.', '_')}_replies"

    @property
    def replies_subjects(self) -> str:
        return f"$KV.{self.replies_bucket}.>"

    @property
    def kv_stream(self) -> str:
        """The JetStream stream behind the KV bucket."""
        return f"KV_{self.kv_bucket}"

    def kv_subject(self, key: str) -> str:
        """The stream subject one KV key is stored under (a consumer watches it)."""
        return f"$KV.{self.kv_bucket}.{key}"

    @property
    def kv_subjects(self) -> str:
        """Every key of the state bucket."""
        return f"$KV.{self.kv_bucket}.>"


class KvKey:
    """Keys of the state bucket."""

    EPOCH = "epoch"
    """Fencing counter, advanced with revision checks."""
    VERSION = "version"
    """The committed VersionInfo."""
    SESSION = "session"
    """The open session id, or empty."""
    LEADER = "leader"
    """The leadership lease (services/controller/leadership.py)."""
    DESIRED = "desired"
    """The fleet's desired state (a FleetState)."""
    COMMITTED = "committed"
    """`committed.<digest of a version string>`: its commit sequence (unique_versions)."""
    DECISION = "decision"
    """The last decided commit (a CommitDecision): written before any worker commits."""
    PUSH_LEASE = "push_lease"
    """The fleet's push lease (a PushLease): the one trainer that may update weights now."""


class ServiceName:
    """NATS micro service names, so `$SRV.PING|INFO|STATS.<name>` finds each kind."""

    CONTROLLER = "rlbus-controller"
    WORKER = "rlbus-worker"
    GENERATE = "rlbus-generate"
    """Only the workers that take generation traffic now."""


UNKNOWN_OP_QUEUE = "rlbus-unknown"
"""Queue group of the controller's catch-all endpoint (one controller answers an unknown op)."""

SENDS_AGAIN_HEADER = "Rlbus-Sends-Again"
"""Request header, "1" on a generate whose caller sends it again after its link came back and
wants to know where (the SDK sets it): the worker that takes it answers RESEND_TO_HEADER first.
Without it the worker sends the answer alone, as a plain request/reply client expects."""

RESEND_TO_HEADER = "Rlbus-Resend-To"
"""Header of a message with no body a worker sends to a generate's reply subject as it takes
the request (one with a request id and SENDS_AGAIN_HEADER): the subject a send again goes to
(the worker's own, `Subjects.generate_at`). A caller sends again after its link came back (a reply sent while it
was down is lost); through the queue group that send could reach another worker, which would
run the request afresh, so it goes to the worker that took it, which answers from its run; a
caller also asks there while no answer came (a reply lost on the worker's side). A send again
of a run still under way gets this word again (the run's reply goes to the reply subject every
send of the call shares). Not an answer: the call waits on."""

HANDED_BACK_HEADER = "Rlbus-Handed-Back"
"""Header of a message with no body a worker sends to a generate's reply subject (one whose
request carried SENDS_AGAIN_HEADER) for a request it will not start: as it stops, one it holds
(arrived while the fleet was paused, queued for a free slot) or one sent again to it that it
does not know; or one that reached it as it left the queue group (withheld, or cut off from its
controller). Nothing of it ran there: the caller sends it again through the queue group (at
once the first time, after a growing pause from 50 ms the next), where another worker takes it
(and holds it while the fleet is paused). Without SENDS_AGAIN_HEADER the caller gets
UNAVAILABLE instead, saying the request was not started."""

FIRST_SEND_HEADER = "Rlbus-First-Send"
"""Request header, "1" on the first send of a command whose id the sender made for that send
(the SDK sets it; never on a resend). No earlier run of that id can exist, so the controller
lands a pause's or a resume's claim (what makes a resend run once) beside its fan-out instead
of before it. Without it the claim lands first: a sender that sets it on a resend may have
its command run twice."""
