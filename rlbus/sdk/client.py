"""The trainer SDK: RLClient (async) and SyncRLClient (same methods, blocking)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal
from nats.aio.client import Client

from rlbus.bus.connection import NatsAuth, connect, drain, request, resolve_url
from rlbus.bus.faults import Fault, expect_reply, fault_of
from rlbus.bus.replies import REASK_S, ReplyInbox
from rlbus.schemas import (
    AnyControlCommand,
    Backend,
    DeadlineExceeded,
    FailedPrecondition,
    FleetAck,
    GenerateReply,
    GenerateRequest,
    GetServerInfo,
    GetWeightVersion,
    IsPaused,
    IsSleeping,
    Pause,
    PauseMode,
    PermissionDenied,
    Resume,
    RLBusError,
    ServerInfo,
    Sleep,
    SleepTag,
    Subjects,
    TensorChecksum,
    Unavailable,
    UpdateTarget,
    UpdateWeightVersion,
    VerifyWeights,
    VersionInfo,
    WakeUp,
    WeightCheck,
    encode,
    generate_reply_decoder,
    op_of,
)
from rlbus.sdk.push import PushStats, WeightPush
from rlbus.sdk.versions import watch_versions

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
QUIET_RETRY_S = 5.0
"""A call retrying longer than this says so at WARNING; shorter retries log at DEBUG."""
log = logging.getLogger("rlbus.sdk.client")

PUSH_CLEANUP_S = 5.0
"""The part of push_weights' deadline kept for aborting and resuming after a failure (at most
a fifth of it): the phases stop that long before the deadline, the cleanup ends by it."""

PUSH_SLACK_S = 1.0
"""How far past its `timeout` a push_weights may return: the cleanup is cut at the deadline
itself, and only unwinding the cancelled call remains (milliseconds, bounded by this in tests)."""

ATTEMPT_S = 5.0
"""A control call resends its command (same id: it runs once) after this long without an answer."""

RETRY_S = 15.0
"""Default retry window while nothing answers: covers a leader's lease (5 s) and a takeover."""


class RLClient:
    """Talks to the controller over NATS. `async with await RLClient.connect(url) as rl: ...`"""

    def __init__(
        self,
        nc: Client,
        *,
        subjects: Subjects | None = None,
        timeout: float = 60.0,
        owns_connection: bool = False,
        retry_s: float = RETRY_S,
    ) -> None:
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.timeout = timeout
        """Deadline of one call; no call waits longer (a fan-out's own deadline is shorter)."""
        self.retry_s = retry_s
        """How long a call keeps retrying while nothing answers its subject (no responders, a
        reconnecting connection): a controller handover, a NATS restart. Within the call's
        deadline; a retry resends the same command id, so it runs once."""
        self.attempt_s = ATTEMPT_S
        """How long one attempt of a control call waits before the same command is sent again
        (on the same reply subject: an answer to any send of it answers the call)."""
        self.reask_s = REASK_S
        """A generate whose worker said it runs it, unanswered this long after its last send, is
        asked of that worker again (then twice as long each time, up to six times this): a reply lost
        on the worker's link, which the caller's own link cannot notice, costs this, not the
        call's deadline."""
        self._owns = owns_connection
        self._replies = ReplyInbox(nc)
        """Where answers arrive: a call keeps one reply subject across its resends."""
        self.trainer_id = uuid.uuid4().hex[:12]
        """Sent with every command (ControlCommand.trainer_id): the fleet's push lease names its holder by it."""
        self.push = WeightPush(self.call, lambda: self.nc.max_payload)
        """The trainer's side of update sessions: transfer group, packing buffers, checksums."""

    @classmethod
    async def connect(
        cls,
        url: str | None = None,
        *,
        prefix: str = "rl",
        timeout: float = 60.0,
        auth: NatsAuth | None = None,
        retry_s: float | None = None,
    ) -> RLClient:
        """Connect to NATS (url or $RLBUS_NATS_URL; credentials from `auth` or $RLBUS_NATS_*)."""
        resolved = resolve_url(url)
        if resolved is None:
            raise Unavailable("no NATS URL: pass url=... or set RLBUS_NATS_URL")
        try:
            nc = await connect(resolved, name="rlbus-trainer", auth=auth)
        except PermissionError as e:
            raise PermissionDenied(str(e)) from None
        except Exception as e:
            raise Unavailable(f"cannot connect to NATS at {resolved}: {e}") from None
        return cls(
            nc,
            subjects=Subjects(prefix=prefix),
            timeout=timeout,
            owns_connection=True,
            retry_s=RETRY_S if retry_s is None else retry_s,
        )

    async def close(self) -> None:
        self.push.close()
        self.push.end_compares()
        if self._owns:
            await drain(self.nc)
        else:
            await self._replies.close()

    async def __aenter__(self) -> RLClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- transport ---------------------------------------------------------------------

    async def call(self, command: AnyControlCommand, expect: type[T], timeout: float | None = None) -> T:
        """Send any control command and return its typed reply (the methods below wrap this);
        a refusal raises the exception for its code. A command without an id gets a fresh one."""
        op = op_of(command)
        t = min(timeout or self.timeout, _left())
        if command.trainer_id is None:  # who sends it: the push lease names its holder by it
            command = msgspec.structs.replace(command, trainer_id=self.trainer_id)
        fresh = not command.command_id  # its first send says no earlier run of its id exists
        if fresh:  # a retry of this command resends it as it is (same id, same bytes)
            command = msgspec.structs.replace(
                command, command_id=uuid.uuid4().hex, timeout_s=round(t, 3) if t != float("inf") else None
            )
        return await self._ask(
            self.subjects.control(op),
            op,
            encode(command),
            expect,
            "the controller",
            t,
            hint="start one with `rlbus up` or `rlbus controller`",
            resend=True,
            fresh=fresh,
        )

    async def _ask(
        self,
        subject: str,
        op: str,
        payload: bytes,
        expect: type[T],
        who: str,
        timeout: float | None = None,
        decoder: Any = None,
        hint: str = "",
        resend: bool = False,
        fresh: bool = False,
        redirects: bool = False,
    ) -> T:
        """One request/reply within the deadline. Retries while nothing answers (within
        retry_s). With `resend` (a command deduplicated by its id) it also waits at most
        attempt_s per attempt and sends the same bytes again: a leader that froze or lost its
        link does not hold the call, the next leader answers (or the same one, from its cache).
        `fresh`: the command's id was made for this call (its first send says so).
        `redirects`: a send again after a reconnect goes where the service that took the call
        said (a generate: the worker running it)."""
        t = min(timeout or self.timeout, _left())
        if t <= 0:
            raise DeadlineExceeded(f"no time left for {op} within the caller's deadline")
        start = time.monotonic()
        delay = 0.05
        nobody: Fault | None = None  # the last UNAVAILABLE (no responders, a link down): what a try cut short ends with
        # every send of this call is answered on one subject: an answer slower than one attempt
        # (a store riding out a node loss) still reaches the call after it sent again
        call = self._replies.call(fresh, redirects, self.reask_s)
        try:
            while True:
                left = t - (time.monotonic() - start)
                # at least three attempts fit in a call: one lost to a leader that went silent
                # leaves time for the resend that reaches its successor
                wait = min(left, self.attempt_s, t / 3) if resend else left
                try:
                    msg = await request(self.nc, subject, payload, wait, call)
                    break
                except PermissionDenied:
                    raise
                except Exception as e:  # no responders, timeout, connection closed
                    fault = fault_of(e, who=who, op=op, timeout=t, hint=hint)
                    waited = time.monotonic() - start
                    if fault.code == "UNAVAILABLE":
                        nobody = fault
                    elif fault.code == "DEADLINE_EXCEEDED" and nobody is not None and wait < min(self.attempt_s, t / 3):
                        # a try the back-off left too little time for timed out: it learned nothing
                        # the tries before it had not (nobody serves this), and the call says that
                        fault = nobody
                    # retries are normal while services start or fail over: quiet unless they last
                    level = logging.WARNING if waited > QUIET_RETRY_S else logging.DEBUG
                    if resend and fault.code == "DEADLINE_EXCEEDED" and waited < t - 0.01:
                        log.log(level, "%s: no answer within %.1fs; sending it again (same id)", op, wait)
                        continue
                    if fault.code != "UNAVAILABLE" or waited + delay >= min(t, self.retry_s):
                        raise fault.error() from None
                    log.log(level, "%s: %s; retrying", op, fault.message)
                    await anyio.sleep(delay)  # back-off between retries, not a wait for a condition
                    delay = min(delay * 2, 0.5)
        finally:
            call.close()
        return expect_reply(msg, op, expect, decoder) if decoder is not None else expect_reply(msg, op, expect)

    # ---- fleet state -------------------------------------------------------------------

    async def server_info(self) -> ServerInfo:
        """Workers, their states and capabilities (AND-aggregated), the committed version."""
        return await self.call(GetServerInfo(), ServerInfo)

    async def pause(self, mode: PauseMode = "abort") -> FleetAck:
        """Pause generation everywhere. abort: end in-flight requests; wait: let them finish;
        keep: freeze them until resume. Idempotent."""
        return await self.call(Pause(mode=mode), FleetAck)

    async def resume(self) -> FleetAck:
        return await self.call(Resume(), FleetAck)

    async def is_paused(self) -> bool:
        """True when every worker is paused."""
        return bool((await self.call(IsPaused(), FleetAck)).answer)

    async def sleep(self, level: int = 1, tags: Sequence[SleepTag] | None = None) -> FleetAck:
        """Free engine memory. level 1: weights to host backup + KV cache freed; level 2: weights
        discarded (push new ones after waking). tags: 'weights', 'kv_cache' (default both)."""
        return await self.call(Sleep(level=level, tags=list(tags) if tags is not None else None), FleetAck)  # type: ignore[arg-type]

    async def wake_up(self, tags: Sequence[SleepTag] | None = None) -> FleetAck:
        return await self.call(WakeUp(tags=list(tags) if tags is not None else None), FleetAck)

    async def is_sleeping(self) -> bool:
        """True while any worker has any part asleep."""
        return bool((await self.call(IsSleeping(), FleetAck)).answer)

    # ---- update sessions (the trainer's side lives in self.push) ----------------------

    @property
    def transfer_ready(self) -> bool:
        """True once init_weight_transfer() built a group that has not been torn down."""
        return self.push.ready

    async def init_weight_transfer(
        self, backend: Backend | None = None, *, master_addr: str | None = None, timeout_s: float = 60.0
    ) -> FleetAck:
        """Open the trainer's side of a transfer group (rank 0) while every worker joins it.

        backend: None = the backend every worker reports. master_addr: this host as workers
        reach it (default $RLBUS_MASTER_ADDR or 127.0.0.1). Collectives time out after timeout_s.
        """
        limit = min(self.timeout, _left())
        try:
            with anyio.fail_after(limit):
                return await self.push.init_transfer(await self.server_info(), backend, master_addr, timeout_s)
        except TimeoutError:
            raise DeadlineExceeded(
                f"init_weight_transfer did not finish within {limit:g}s (the workers did not all join)"
            ) from None

    async def start_weight_update(self, *, delta: bool = False) -> FleetAck:
        """Open an update session for the main model on every worker.

        delta: send only the elements whose bits changed since the last commit this client
        sent with delta=True (it keeps a host copy of those bits). A fleet not exactly on that
        commit refuses and the session opens dense instead (`last_push.fallback` says why)."""
        return await self.push.start("main", delta)

    async def start_draft_weight_update(self, *, delta: bool = False) -> FleetAck:
        """Open an update session whose target is the draft (speculative decoding) model."""
        return await self.push.start("draft", delta)

    @property
    def last_push(self) -> PushStats | None:
        """What the last finished (or failed) session sent: delta or dense, why it fell back to
        dense, tensors and elements changed, bytes sent against the dense bytes."""
        return self.push.last

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int | None = None
    ) -> FleetAck:
        """Send tensors to every worker: metadata through the controller (every worker checks
        names, dtypes and shapes first), then the bytes out-of-band in checksummed buckets,
        each packed and hashed while the one before it is on the wire."""
        return await self.push.update(named_tensors, bucket_bytes)

    async def finish_weight_update(self, weight_version: str | None = None) -> FleetAck:
        """Commit on every worker (two-phase) and publish the version; None keeps the version string.

        Carries the checksum of every bucket this client sent in the session, which each
        worker verifies before it reports ready: finish from the client that sent the bytes."""
        return await self.push.finish(weight_version)

    async def abort_weight_update(self, reason: str = "") -> FleetAck:
        """Drop the open session everywhere; old weights and version stay."""
        return await self.push.abort(reason)

    async def update_weight_version(self, new_version: str) -> FleetAck:
        """Set the version string without a transfer (refused while a session is open)."""
        return await self.call(UpdateWeightVersion(new_version=new_version), FleetAck)

    async def get_weight_version(self) -> str:
        """The version every worker holds; an error naming who disagrees otherwise."""
        return (await self.get_weight_version_info()).version

    async def get_weight_version_info(self) -> VersionInfo:
        """get_weight_version() with its commit sequence (`seq`, ordered: newer is greater),
        the draft's, and when and by which epoch it was committed."""
        return await self.call(GetWeightVersion(), VersionInfo)

    async def verify_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, *, draft: bool = False
    ) -> WeightCheck:
        """Does every worker serve the same bits? Each hashes the weights it serves (the main
        model, or the draft); given the trainer's tensors, each is compared with them, else the
        replicas with each other. `.ok`, and `.mismatched` names every worker that differs (its
        entry in `.workers` names the tensors). Costs one read of the weights on every worker
        (about the time to hash them at ~10 GB/s per core), and waits for a running push."""
        from rlbus.transfer.buckets import as_bytes
        from rlbus.transfer.checksum import checksum

        expected = [
            TensorChecksum(name=n, checksum=checksum(as_bytes(t.detach().cpu()))) for n, t in (named_tensors or [])
        ]
        return await self.call(VerifyWeights(target="draft" if draft else "main", expected=expected), WeightCheck)

    def watch_versions(self) -> AsyncIterator[VersionInfo]:
        """Yield the committed version first, then each new one. Backed by JetStream KV, so
        a subscriber that was disconnected, even while it was still subscribing, still ends
        on the current version."""
        return watch_versions(self.nc, self.subjects)

    async def push_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: str | None = None,
        *,
        pause_mode: PauseMode = "wait",
        draft: bool = False,
        delta: bool = False,
        bucket_bytes: int | None = None,
        timeout: float | None = None,
    ) -> FleetAck:
        """pause -> start -> update -> finish -> resume.

        A failure in any phase aborts the session everywhere (old weights and version stay)
        and re-raises, leaving the fleet as the push found it: resumed if the push paused it
        (also when the pause itself failed half-way, some workers paused and some not); a
        fleet that was already paused stays paused. A resume that fails after the commit
        raises its own error type, its message saying the version committed (`last_push.committed`
        is True): the new weights stand and the fleet stays paused; call resume().

        delta: send only what changed since this client's last delta=True commit (see
        start_weight_update); falls back to dense by itself. `last_push` reports either way.

        One deadline bounds the whole call, cleanup included: `timeout` (default: the
        client's). The phases share it; the last PUSH_CLEANUP_S (at most a fifth) is kept for
        the abort and resume of a push that failed or ran out of time (DEADLINE_EXCEEDED), and
        they end by the deadline too (what they could not finish is reported in the log; the
        controller gives up on a command with its caller). The call returns at most
        PUSH_SLACK_S after `timeout`. A session already open (another trainer's push) is
        refused at once, before anything is paused."""
        total = min(timeout or self.timeout, _left())
        deadline = anyio.current_time() + total
        reserve = min(PUSH_CLEANUP_S, total / 5)
        try:
            with anyio.fail_after(total - reserve):
                ack = await self._push(named_tensors, version, pause_mode, draft, delta, bucket_bytes, deadline)
        except TimeoutError:
            raise DeadlineExceeded(
                f"push_weights did not finish within {total:g}s; its session was aborted and the fleet left as it was"
            ) from None
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time()), shield=True):
                await self.resume()
        except TimeoutError:
            raise DeadlineExceeded(
                f"push_weights committed {ack.weight_version} but the fleet did not resume "
                f"within its {total:g}s; call resume()"
            ) from None
        except RLBusError as e:  # committed all the same: the caller hears that, and that the fleet is paused
            raise type(e)(
                f"push_weights committed {ack.weight_version} but the fleet did not resume ({e.message}); "
                "call resume()",
                e.failures,
            ) from e
        return ack

    async def _push(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: str | None,
        pause_mode: PauseMode,
        draft: bool,
        delta: bool,
        bucket_bytes: int | None,
        deadline: float,
    ) -> FleetAck:
        info = await self.server_info()
        if info.session_id:
            raise FailedPrecondition(
                f"session {info.session_id} is open (another trainer pushing?); wait for it, or abort it, and retry"
            )
        found_paused = info.desired.paused
        opened = False
        try:
            paused = await self.pause(pause_mode)
            fleet = [w.worker_id for w in paused.workers]
            if not self.push.ready or fleet != self.push.group or not all(w.transfer_ready for w in paused.workers):
                await self.init_weight_transfer()  # no group yet, or the fleet changed since
            target: UpdateTarget = "draft" if draft else "main"
            try:
                await self.push.start(target, delta)
            except FailedPrecondition:
                if not await self._out_of_group():
                    raise
                # a repair since the pause: its receivers left its group with none; rebuild once
                await self.init_weight_transfer()
                await self.push.start(target, delta)
            opened = True  # only a session this client knows it opened is aborted (by its id)
            await self.push.update(named_tensors, bucket_bytes)
            return await self.push.finish(version)
        except BaseException as e:
            with anyio.CancelScope(deadline=deadline, shield=True):  # the cleanup ends by the push's deadline
                await self._undo(e, opened, resume=not found_paused, deadline=deadline)
            raise

    async def _out_of_group(self) -> bool:
        """A worker is out of the transfer group this client built: the controller repaired it
        between the push's pause and its start (a repair's receivers leave its group with none)."""
        init = self.push.init
        info = await self.server_info()
        return init is not None and any(w.state.transfer_group != init.group_name for w in info.workers)

    async def _undo(self, failure: BaseException, opened: bool, *, resume: bool, deadline: float) -> None:
        """After a failed push: abort its session (if it got that far), resume the fleet if the
        push paused it, and drop the transfer group if a worker left it. Within `deadline`:
        the abort takes at most half of what is left when a resume must follow."""
        states = None
        if opened and self.push.session_id is not None:
            share = (deadline - anyio.current_time()) / 2 if resume else float("inf")
            with anyio.move_on_after(share) as cut:
                try:
                    states = (await self.push.abort(f"push failed: {failure}")).workers
                except RLBusError as e:
                    log.warning("abort after a failed push also failed: %s", e)
            if cut.cancelled_caught:
                log.warning("abort after a failed push got no answer before the push's deadline")
        if resume:
            try:
                states = (await self.resume()).workers
            except RLBusError as e:
                log.warning("resume after a failed push failed: %s; the fleet may stay paused", e)
        if states is None:
            try:
                states = [w.state for w in (await self.server_info()).workers]
            except RLBusError:
                return
        if self.push.ready and not all(w.transfer_ready for w in states):
            self.push.close()  # a worker left the group: rebuild it next time

    # ---- generation --------------------------------------------------------------------

    async def generate(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int = 16,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        return_logprobs: bool = False,
        timeout: float | None = None,
    ) -> GenerateReply:
        """Generate on one worker (NATS queue group picks it). The reply names the weight version used."""
        req = GenerateRequest(
            prompt_tokens=list(prompt_tokens),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            return_logprobs=return_logprobs,
            request_id=uuid.uuid4().hex,  # a send after a reconnect is the same request
        )
        return await self._ask(
            self.subjects.generate,
            "generate",
            encode(req),
            GenerateReply,
            "a worker serving generation",
            timeout,
            generate_reply_decoder,
            redirects=True,
        )


def _left() -> float:
    """Seconds to the enclosing deadline (inf without one)."""
    return anyio.current_effective_deadline() - anyio.current_time()


class SyncRLClient:
    """RLClient for trainers without an event loop: same methods, blocking.

    The NATS connection lives on a private event loop in a background thread.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str = "rl",
        timeout: float = 60.0,
        auth: NatsAuth | None = None,
        retry_s: float | None = None,
    ) -> None:
        self._portal_cm = start_blocking_portal()
        self._portal: BlockingPortal = self._portal_cm.__enter__()
        try:
            self._client: RLClient = self._portal.call(
                lambda: RLClient.connect(url, prefix=prefix, timeout=timeout, auth=auth, retry_s=retry_s)
            )
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    @classmethod
    def connect(cls, url: str | None = None, **kw: Any) -> SyncRLClient:
        return cls(url, **kw)

    def close(self) -> None:
        try:
            self._portal.call(self._client.close)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncRLClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def watch_versions(self) -> Iterator[VersionInfo]:
        """Blocking form of RLClient.watch_versions()."""
        agen = self._client.watch_versions()
        try:
            while True:
                try:
                    yield self._portal.call(agen.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            self._portal.call(agen.aclose)  # type: ignore[attr-defined, call-arg]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._portal.call(lambda: attr(*args, **kwargs))

        call.__name__ = name
        call.__doc__ = attr.__doc__
        return call
