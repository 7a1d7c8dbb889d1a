"""The worker service: the engine behind NATS endpoints.

Endpoints: rl.worker.<id>.<op> (commands from the controller) and rl.generate (queue group).
It announces itself on rl.worker.ready, re-announces on rl.controller.hello, beats on
rl.worker.heartbeat and says goodbye on rl.worker.gone when it stops.

It owns the worker's books (book.py: what it holds, whether it is withheld, its fence) and
brings the engine to every state asked of it through one `converge(target)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.micro import add_service
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service
from rlbus.schemas import (
    HANDED_BACK_HEADER,
    RESEND_TO_HEADER,
    SENDS_AGAIN_HEADER,
    SLEEP_TAGS,
    UNDECODABLE_STATUS,
    AbortWeightUpdateWorker,
    Backend,
    Capabilities,
    CommitWorker,
    ControllerHello,
    FailedPrecondition,
    FleetState,
    HashWeightsWorker,
    Heartbeat,
    InitWeightTransferWorker,
    InvalidArgument,
    LeaveWeightTransferWorker,
    OfferWeightsWorker,
    PauseWorker,
    PrepareWorker,
    ResumeWorker,
    RLBusError,
    SendWeightsWorker,
    ServiceName,
    SleepWorker,
    StartWeightUpdateWorker,
    StatusWorker,
    Subjects,
    SyncWorker,
    Unavailable,
    UpdateMode,
    UpdateWeightsWorker,
    UpdateWeightVersionWorker,
    WakeUpWorker,
    WorkerAck,
    WorkerCommand,
    WorkerGone,
    WorkerReady,
    WorkerState,
    check_token,
    encode,
    event_decoder,
    generate_request_decoder,
    op_of,
)
from rlbus.schemas.codec import DecodeError
from rlbus.services.endpoints import Endpoints, Handler, NotRunning, Reply, Routes

from rlbus.bus.connection import request, stop_service

from .book import Book, WeightLabel
from .engine import Engine, NotStarted
from .generations import Generations
from .repair import RepairSource
from .updates import WeightUpdates
from .verify import hash_weights

log = logging.getLogger("rlbus.worker")

SERVICE_VERSION = "0.1.0"

ID_PROBE_TIMEOUT_S = 2.0
"""How long the startup check waits for a live worker that holds the same id to answer."""


class WorkerOptions(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    subjects: Subjects = Subjects()
    weight_transfer_backend: Backend | None = None
    update_mode: UpdateMode = "staged"
    heartbeat_s: float = 1.0
    drain_timeout_s: float = 10.0
    """On stop, how long in-flight requests get to finish before they are aborted."""
    receive_timeout_s: float = 60.0
    """Phase 1 of finish waits at most this long for the weight bytes to arrive."""


class WorkerService:
    """Serves one engine. Run with `await service.run(task_status)` inside a task group."""

    def __init__(self, nc: Client, engine: Engine, options: WorkerOptions) -> None:
        check_token(options.worker_id, "worker id")
        self.nc = nc
        self.engine = engine
        self.opts = options
        self.subjects = options.subjects
        self.id = options.worker_id
        self.book = Book()
        """What it holds and how it stands: the one owner of the worker's bookkeeping."""
        engine.attach(self.book)
        self._micro: Service | None = None
        self._stop = anyio.Event()
        self._tg: anyio.abc.TaskGroup = NotRunning()  # type: ignore[assignment]
        self._endpoints = Endpoints(self._tg, f"worker {self.id}")
        self.updates = WeightUpdates(engine, self.book, options.weight_transfer_backend, options.update_mode)
        self.repair = RepairSource(engine, options.weight_transfer_backend)
        """Sends this worker's committed weights to workers that are behind (repair.py)."""
        self._liveness_s = 3.0
        self._recovering = False
        """The engine was seen recovering from a failed load (see _follow_recovery)."""
        self._last_beat = time.monotonic()
        self._generate_service: Service | None = None
        self._generations = Generations()

    # ---- identity ----------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        e = self.engine
        return Capabilities(
            sleep_mode_enabled=e.sleep_mode_enabled,
            weight_transfer_backend=self.opts.weight_transfer_backend,
            has_draft_model=e.has_draft_model,
            supports_draft_weight_updates=e.supports_draft_weight_updates,
            model_name=e.model_name,
            num_params=e.num_params,
            update_mode=self.opts.update_mode,
            transfer_ranks=e.transfer_ranks,
        )

    def state(self) -> WorkerState:
        """What the engine reports of the model, the books, and the open session."""
        e, b, u = self.engine, self.book, self.updates
        st, main, draft, init = e.status(), b.main, b.draft, u.init
        # every field named: a call that merges a dict of the status into keywords costs twice
        # this, once per command (tests/unit/test_worker_state.py checks none is left out)
        return WorkerState(
            worker_id=self.id,
            paused=st.paused,
            pause_mode=st.pause_mode,
            sleeping_tags=st.sleeping_tags,
            sleep_level=st.sleep_level,
            weights_loaded=st.weights_loaded,
            in_flight=st.in_flight,
            waiting=st.waiting,
            param_bytes=st.param_bytes,
            kv_cache_bytes=st.kv_cache_bytes,
            draft_stale=st.draft_stale,
            spec_proposed=st.spec_proposed,
            spec_accepted=st.spec_accepted,
            epoch=b.epoch,
            controller_id=b.controller_id,
            weight_version=main.version,
            weight_seq=main.seq,
            draft_version=draft.version if e.has_draft_model else None,
            draft_seq=draft.seq,
            dirty=b.dirty or e.recovering,  # a vLLM restarting after a failed load is dirty too
            withheld=b.withheld,
            session_id=u.session_id,
            transfer_ready=u.transfer_ready,
            transfer_group=init.group_name if init else None,
        )

    def ack(self) -> WorkerAck:
        return WorkerAck(state=self.state())

    async def announce(self) -> None:
        await self.nc.publish(
            self.subjects.worker_event(self.id, "ready"),
            encode(WorkerReady(worker_id=self.id, capabilities=self.capabilities(), state=self.state())),
        )

    # ---- lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until stop(); then drain: in-flight requests finish and reply.

        Refuses to start (FailedPrecondition naming the id) while another live worker holds
        this worker id: two workers under one id would answer for each other."""
        await self._claim_id()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._endpoints = eps = Endpoints(tg, f"worker {self.id}")
            self._micro = await add_service(
                self.nc,
                name=ServiceName.WORKER,
                version=SERVICE_VERSION,
                description="rlbus inference worker",
                metadata={"worker_id": self.id, "model": self.engine.model_name},
            )
            await eps.serve(
                self._micro.add_group(name=self.subjects.worker_group(self.id)), self._routes(), wrap=self._fenced
            )
            # No unknown-op catch-all here (the controller has one): it would deliver every
            # command twice on the hot path; an unknown worker op gets NATS' no-responders.
            hello = await self.nc.subscribe(self.subjects.controller_hello, cb=self._on_hello)
            again = await self.nc.subscribe(self.subjects.generate_at(self.id), cb=self._on_generate_again)
            await self.nc.flush()
            await self.announce()
            tg.start_soon(self._heartbeat)
            task_status.started()
            await self._stop.wait()
            # drain: stop taking work, let in-flight work answer, then leave
            self.updates.cancel_join()  # a group still forming would only hold the drain up
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(2):  # unsubscribing needs a live connection
                    await hello.unsubscribe()
                    await self._serve_generation(False)
                    await stop_service(self._micro)
                self.engine.hand_back()  # what it holds and has not started goes to another worker now
                with anyio.move_on_after(self.opts.drain_timeout_s):
                    await eps.wait_idle()
                if eps.in_flight:
                    await self.engine.pause("abort")  # frozen/long requests end with status abort
                    with anyio.move_on_after(2):
                        await eps.wait_idle()
                    await self.engine.resume()
                with anyio.move_on_after(2):  # the runs it drained were asked after here until now
                    await again.unsubscribe()
                with anyio.move_on_after(2):
                    try:
                        await self.nc.publish(
                            self.subjects.worker_event(self.id, "gone"),
                            encode(WorkerGone(worker_id=self.id, reason="stopped")),
                        )
                        await self.nc.flush(timeout=2)
                    except Exception as e:
                        log.warning("worker %s: could not say goodbye: %s", self.id, e)
            self.updates.abort("")
            self.updates.teardown()
            self.repair.close()
            tg.cancel_scope.cancel()

    def stop(self) -> None:
        self._stop.set()

    async def _claim_id(self) -> None:
        """Ask whoever serves this id's status subject: any answer, even a refusal, means a
        live worker holds the id. No responders means it is free (a dead worker's
        subscriptions go with its connection). A holder that does not answer in time is
        frozen, not gone (SIGSTOP, a partition): refused as well, since it may come back."""
        subject = self.subjects.worker(self.id, op_of(StatusWorker))
        try:
            await request(self.nc, subject, b"", ID_PROBE_TIMEOUT_S)
        except NoRespondersError:
            return
        except NatsTimeout:
            raise FailedPrecondition(
                f"worker id {self.id!r} is held by a worker that does not answer (frozen or partitioned); "
                "stop it or pick another --id"
            ) from None
        raise FailedPrecondition(
            f"worker id {self.id!r} is already in use by a live worker; stop it or pick another --id"
        )

    async def _follow_recovery(self) -> None:
        """An engine bringing back its committed weights after a failed load takes no traffic;
        once it is back, the controller reconciles it like any rejoining worker."""
        if self.engine.recovering and not self._recovering:
            log.warning("worker %s: its engine is recovering from a failed load; withheld from generation", self.id)
            self._recovering = True
            await self._withhold(True)
        elif self._recovering and not self.engine.recovering:
            self._recovering = False
            await self.announce()

    def _silent_too_long(self) -> bool:
        """The event loop did not run for longer than the liveness timeout (SIGSTOP, a stall):
        the controller has likely dropped this worker and the fleet may have moved on."""
        return time.monotonic() - self._last_beat > self._liveness_s

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(self.opts.heartbeat_s)
            if self._silent_too_long() and not self.book.withheld:
                log.warning(
                    "worker %s was silent %.1fs: no generation until the controller reconciles it",
                    self.id,
                    time.monotonic() - self._last_beat,
                )
                await self._withhold(True)
                await self.announce()
            await self._follow_recovery()
            self._last_beat = time.monotonic()
            if self.nc.is_connected:
                try:
                    await self.nc.publish(
                        self.subjects.worker_event(self.id, "heartbeat"),
                        encode(Heartbeat(worker_id=self.id, state=self.state())),
                    )
                except Exception as e:  # reconnecting; the next beat retries
                    log.debug("heartbeat failed: %s", e)

    async def _on_hello(self, msg) -> None:
        try:
            hello = event_decoder.decode(msg.data)
        except DecodeError:
            return
        if isinstance(hello, ControllerHello):
            if hello.epoch > self.book.epoch:  # a newer controller: fence the older one out at once
                self.book.follow(hello.controller_id, hello.epoch)
            # an equal epoch from another controller is not adopted: announcing (epoch, controller)
            # as they are tells that controller its epoch was already used (its state was lost)
            await self.announce()

    # ---- commands ----------------------------------------------------------------------

    def _routes(self) -> Routes:
        """The worker's dispatch table. Inline handlers never wait (answered inside the NATS
        callback); pause waits for requests in wait/keep mode, so it is inline only when idle, and
        prepare only when every receive is done and nothing is left to hash in a thread."""
        r = Routes()
        r.add(PauseWorker, self._pause, inline=self._idle)
        r.add(ResumeWorker, self._resume, inline=True)
        r.add(SleepWorker, self._sleep)
        r.add(WakeUpWorker, self._wake_up)
        r.add(StatusWorker, self._status, inline=True, read=True)
        r.add(InitWeightTransferWorker, self._join_transfer)
        r.add(StartWeightUpdateWorker, self._open_session, inline=True)
        r.add(UpdateWeightsWorker, self._receive_weights)
        r.add(PrepareWorker, self._prepare, inline=self._prepares_at_once)
        r.add(CommitWorker, self._commit)
        r.add(AbortWeightUpdateWorker, self._abort_session, inline=True)
        r.add(UpdateWeightVersionWorker, self._set_version)
        r.add(SyncWorker, self._sync)
        r.add(HashWeightsWorker, self._hash_weights, read=True)
        r.add(OfferWeightsWorker, self._offer_weights)
        r.add(SendWeightsWorker, self._send_weights)
        r.add(LeaveWeightTransferWorker, self._leave_transfer, inline=True)
        return r

    def _idle(self, cmd: PauseWorker) -> bool:
        """No request in flight: a pause in any mode returns at once, so it can run inline."""
        return self.engine.requests_in_flight() == 0

    def _prepares_at_once(self, cmd: PrepareWorker) -> bool:
        """Every receive done, nothing to hash in a thread: the prepare compares checksums only."""
        return self.updates.prepares_at_once(cmd.session_id, cmd.tensor_checksums)

    def _fenced(self, handler: Handler) -> Handler:
        async def run(cmd: WorkerCommand) -> object:
            if cmd.epoch < self.book.epoch:
                raise FailedPrecondition(
                    f"command from controller epoch {cmd.epoch} refused: epoch {self.book.epoch} has taken over"
                )
            result = await handler(cmd)
            self.book.obey(cmd.epoch)  # only a command that ran moves the fence
            return result

        return run

    # ---- pause, sleep and their opposites: one way to the state asked for -----------------

    async def converge(self, want: FleetState, held: FleetState | None = None) -> None:
        """Bring the engine to `want`: paused in its mode (or running), the parts asleep that it
        names and no others. Every pause, resume, sleep and wake goes through here, commanded
        one at a time or synced as a whole (the fleet's desired state). `held`: the engine's
        stance read just before, with nothing awaited since."""
        held = held or self.engine.stance()
        if want.paused and (not held.paused or held.pause_mode != want.pause_mode):
            await self.engine.pause(want.pause_mode or "abort")
        elif not want.paused and held.paused:
            await self.engine.resume()
        to_sleep = [t for t in want.sleeping_tags if t not in held.sleeping_tags]
        if to_sleep:
            await self.engine.sleep(want.sleep_level or 1, to_sleep)
            if "weights" in to_sleep:
                self.updates.abort("")  # an update session cannot survive its weights going to sleep
        to_wake = [t for t in held.sleeping_tags if t not in want.sleeping_tags]
        if to_wake:
            await self.engine.wake_up(to_wake)

    async def _change(self, to: Callable[[FleetState], FleetState]) -> WorkerAck:
        """One command's change of where the engine stands: its stance read once, then
        converged to `to(held)`."""
        held = self.engine.stance()
        await self.converge(to(held), held)
        return self.ack()

    async def _pause(self, cmd: PauseWorker) -> WorkerAck:
        return await self._change(lambda held: msgspec.structs.replace(held, paused=True, pause_mode=cmd.mode))

    async def _resume(self, cmd: ResumeWorker) -> WorkerAck:
        return await self._change(lambda held: msgspec.structs.replace(held, paused=False, pause_mode=None))

    async def _sleep(self, cmd: SleepWorker) -> WorkerAck:
        tags = _tags(cmd.tags)

        def asleep(held: FleetState) -> FleetState:
            also = [t for t in SLEEP_TAGS if t in tags or t in held.sleeping_tags]
            return msgspec.structs.replace(held, sleep_level=cmd.level, sleeping_tags=also)

        return await self._change(asleep)

    async def _wake_up(self, cmd: WakeUpWorker) -> WorkerAck:
        tags = _tags(cmd.tags)
        return await self._change(
            lambda held: msgspec.structs.replace(held, sleeping_tags=[t for t in held.sleeping_tags if t not in tags])
        )

    # ---- the other commands -----------------------------------------------------------------

    async def _status(self, cmd: StatusWorker) -> WorkerAck:
        return self.ack()

    async def _join_transfer(self, cmd: InitWeightTransferWorker) -> WorkerAck:
        await self.updates.join(cmd.init_info, cmd.rank)
        return self.ack()

    async def _open_session(self, cmd: StartWeightUpdateWorker) -> WorkerAck:
        if cmd.base_seq is not None and self.updates.session_id != cmd.session_id:
            problem = self.updates.base_problem(cmd.target, cmd.base_seq)
            if problem:
                raise FailedPrecondition(f"worker {self.id} cannot apply a delta: {problem}; push dense weights")
        self.updates.start(cmd.session_id, cmd.target, cmd.base_seq, repair=cmd.repair)
        return self.ack()

    async def _receive_weights(self, cmd: UpdateWeightsWorker) -> WorkerAck:
        if cmd.check_only:
            self.updates.check(cmd.session_id, cmd.params, cmd.buckets)
        else:
            self.updates.receive(cmd.session_id, cmd.params, cmd.buckets, self._tg)
        return self.ack()

    async def _prepare(self, cmd: PrepareWorker) -> WorkerAck:
        results = {"tensor_checksums": cmd.tensor_checksums} if cmd.tensor_checksums else {}  # a delta session's
        await self.updates.prepare(cmd.session_id, self.opts.receive_timeout_s, cmd.checksums, **results)
        return self.ack()

    async def _commit(self, cmd: CommitWorker) -> WorkerAck:
        target = self.updates.session.target if self.updates.session else "main"
        try:
            await self.updates.commit(cmd.session_id, cmd.weight_version, cmd.seq)
        except Exception:
            await self._follow_recovery()  # a failed load: out of the generate queue at once
            raise
        if target == "main":
            await self._withhold(False)  # it holds the committed weights now
        return self.ack()

    async def _abort_session(self, cmd: AbortWeightUpdateWorker) -> WorkerAck:
        self.updates.abort(cmd.session_id)
        return self.ack()

    async def _set_version(self, cmd: UpdateWeightVersionWorker) -> WorkerAck:
        self.updates.set_version(cmd.new_version, cmd.seq)
        await self._withhold(False)
        return self.ack()

    async def _sync(self, cmd: SyncWorker) -> WorkerAck:
        """Take the fleet's desired state, then generation traffic if it holds the committed version."""
        self._liveness_s = cmd.liveness_s
        self._last_beat = time.monotonic()
        self.book.follow(cmd.controller_id)
        await self.converge(cmd.desired)
        # current only on exactly the committed (version, seq): a seq names one set of bits, a string may not
        current = self.book.holds(WeightLabel(cmd.committed_version, cmd.seq))
        await self._withhold(not current)
        return self.ack()

    async def _hash_weights(self, cmd: HashWeightsWorker) -> WorkerAck:
        sums = await hash_weights(self.engine, cmd.target)
        return WorkerAck(
            state=self.state(), tensor_checksums=sums, live_checksum=await self.engine.live_checksum(cmd.target)
        )

    async def _offer_weights(self, cmd: OfferWeightsWorker) -> WorkerAck:
        if self.book.withheld:
            raise FailedPrecondition(
                f"worker {self.id} is withheld (not on the committed weights): it cannot be a repair source"
            )
        return WorkerAck(state=self.state(), offer=self.repair.offer(cmd.target, cmd.init_info))

    async def _send_weights(self, cmd: SendWeightsWorker) -> WorkerAck:
        return WorkerAck(
            state=self.state(),
            sent_checksums=await self.repair.send(cmd.group_name, cmd.first, cmd.last, cmd.checksums),
        )

    async def _leave_transfer(self, cmd: LeaveWeightTransferWorker) -> WorkerAck:
        if self.repair.group_name == cmd.group_name:
            self.repair.close()
        if (
            self.updates.init is not None
            and self.updates.init.group_name == cmd.group_name
            and self.updates.session is None
        ):
            self.updates.teardown()
        return self.ack()

    async def _withhold(self, behind: bool) -> None:
        """Withhold this worker from generation while it is behind the committed version."""
        if self.book.withhold(behind):
            log.log(
                logging.WARNING if behind else logging.INFO,
                "worker %s %s",
                self.id,
                "withheld: no generation until it holds the committed weights" if behind else "serves generation",
            )
        await self._serve_generation(not behind)

    async def _serve_generation(self, on: bool) -> None:
        """Join or leave the rl.generate queue group (a withheld worker takes no traffic).

        Generation is its own micro service (`rlbus-generate`), so `$SRV.INFO.rlbus-generate`
        lists exactly the workers that take traffic now.
        """
        if on and self._generate_service is None:
            svc = await add_service(
                self.nc,
                name=ServiceName.GENERATE,
                version=SERVICE_VERSION,
                description="rlbus generation (reference engine)",
                metadata={"worker_id": self.id},
            )
            await svc.add_endpoint(
                name="generate",
                subject=self.subjects.generate,
                queue_group=self.subjects.generate_queue,
                handler=self._on_generate,
            )
            self._generate_service = svc
        elif not on and self._generate_service is not None:
            svc, self._generate_service = self._generate_service, None
            await stop_service(svc)  # also on a dead link (thawed from a freeze): never raises

    # ---- generation --------------------------------------------------------------------

    async def _on_generate(self, req: Request) -> None:
        await self._generate(req, again=False)

    async def _on_generate_again(self, msg: Msg) -> None:
        """A generate sent again to this worker, which took it and said so (RESEND_TO_HEADER)."""
        req = Request(msg)
        try:
            await self._generate(req, again=True)
        except ServiceError as e:  # undecodable: no micro endpoint around this subscription answers it
            await req.respond_error(e.code, e.description)

    async def _say_where(self, req: Request, request_id: str) -> None:
        """Tell the caller this worker runs `request_id`, and where a send again goes."""
        try:
            await req.respond(b"", headers={RESEND_TO_HEADER: self.subjects.generate_at(self.id)})
        except Exception as e:  # a dead link: the answer goes out (or is lost) after it all the same
            log.debug("worker %s: could not say where to send %s again: %s", self.id, request_id, e)

    async def _generate(self, req: Request, again: bool) -> None:
        """Run a generate, or answer from this worker's run of its request id (see Generations).
        One taken from the queue group tells a caller that asks (SENDS_AGAIN_HEADER) where a
        send again goes (RESEND_TO_HEADER: this worker's own subject). One sent again here,
        even while the worker is withheld: of a run still under way, the same word (the run's
        reply goes to the reply subject the caller's sends share); of a run answered lately,
        that run's reply; of a run this worker does not know, a run here."""
        try:
            gen = generate_request_decoder.decode(req.data)
        except DecodeError as e:
            raise ServiceError(UNDECODABLE_STATUS, f"undecodable generate payload: {e}") from None
        rid = gen.request_id
        if again and rid is not None and self._generations.runs(rid):
            # still under way: its reply goes to the reply subject the caller's sends share; this
            # send is told the run is here (asked again after it, the finished run answers)
            await self._say_where(req, rid)
            return
        ours = again and rid is not None and rid in self._generations
        if again and not ours and self._stop.is_set():  # stopping: no new run here
            await self._endpoints.send(req, self._hand_back(req, f"worker {self.id} is stopping"))
            return
        if not ours and (self.book.withheld or self._silent_too_long()):  # delivered before it left the queue group
            await self._endpoints.send(
                req, self._hand_back(req, f"worker {self.id} is not serving (rejoining the fleet)")
            )
            return
        if rid is not None and not again and (req.headers or {}).get(SENDS_AGAIN_HEADER) == "1":
            await self._say_where(req, rid)

        async def work() -> bytes | None:
            try:
                r = await self.engine.generate(gen)
            except NotStarted:
                return None  # kept nowhere: handed back below, a send again runs it
            except RLBusError as e:
                return encode(e.to_nack())
            return encode(msgspec.structs.replace(r, worker_id=self.id))

        async def answer() -> bytes | Reply:
            # a send that finds a run of its request id under way waits for it
            reply = await self._generations.run(rid, work)
            return reply if reply is not None else self._hand_back(req, f"worker {self.id} is stopping")

        self._endpoints.spawn(req, answer)

    def _hand_back(self, req: Request, why: str) -> Reply:
        """The answer to a generate this worker will not start (it stops, or it left the queue
        group as this one was delivered): the word that sends it through the queue group again
        at once (HANDED_BACK_HEADER) to a caller that understands it (SENDS_AGAIN_HEADER), else
        UNAVAILABLE saying `why` it was not started."""
        if (req.headers or {}).get(SENDS_AGAIN_HEADER) == "1":
            return Reply(b"", {HANDED_BACK_HEADER: "1"})
        return Reply(encode(Unavailable(f"{why}: the request was not started there; send it again").to_nack()))


def _tags(tags: list | None) -> list:
    if tags is None:
        return list(SLEEP_TAGS)
    if not tags:
        raise InvalidArgument(f"tags must be None (all) or a non-empty subset of {list(SLEEP_TAGS)}")
    return list(dict.fromkeys(tags))
