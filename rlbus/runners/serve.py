"""Run one service in the foreground until SIGINT/SIGTERM, then drain it."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import NoReturn, Protocol

import anyio
from nats.aio.client import Client

from rlbus.bus.connection import NatsAuth, connect, denials_of, drain
from rlbus.schemas import RLBusError

log = logging.getLogger("rlbus.runners.serve")


class Service(Protocol):
    async def run(self, *, task_status=...) -> None: ...

    def stop(self) -> None: ...


def freeze_startup_heap(name: str) -> None:
    """Once a service process has started: collect, then take every object alive now (the
    imports, the engine and its model's Python objects) out of the cyclic collector's walks
    (gc.freeze). A full collection walks every tracked object, with the event loop stopped
    meanwhile: ~0.4 M objects and 140-300 ms in a process with vLLM imported (measured here),
    ~40 k and 12 ms in a controller. After this it walks only what was made since. Refcounting
    still frees whatever is dropped; only a cycle among objects frozen here is never collected."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "%s: started; %d objects alive at startup frozen out of the collector's walks (%.0f ms)",
        name,
        gc.get_freeze_count(),
        (time.perf_counter() - began) * 1e3,
    )


def _exit_code(e: SystemExit) -> int:
    """The status Python itself would exit with for ``e`` (a message is printed, status 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """Run a service process's ``main``, then end the process at once with its status.

    The exit handlers run and the output is flushed, but the interpreter is not finalized.
    A finalizing Python 3.11-3.13 ends any daemon thread that takes the GIL with pthread_exit,
    and a thread coming back from a torch.distributed wait unwinds through C++ that may not
    unwind: the process aborts ("terminate called without an active exception", SIGABRT).
    A worker stopped mid-receive has such a thread: its group was closed, and the receive
    wakes with an error while the process exits (1 in 30 SIGTERMs to a worker process
    mid-push aborted). rlbus.transfer's own exit handler waits for such threads, but only
    for ``EXIT_SETTLE_S`` and only for its own calls; a service process never finalizes.
    """
    code = 0
    try:
        main()
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what finalizing would run first: logging.shutdown among them
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class _Started:
    """The task status serve() hands its service: once the service has started, its process's
    startup heap is frozen (freeze_startup_heap)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def started(self, value: object = None) -> None:
        freeze_startup_heap(self.name)


class ServiceDenied(SystemExit):
    """The NATS server denied the service a subject it needs: a fatal misconfiguration."""


class ServiceRefused(SystemExit):
    """The service refused to start (it logged why, e.g. its worker id is held by a live worker)."""


async def serve(
    url: str,
    name: str,
    make: Callable[[Client], Awaitable[Service] | Service],
    *,
    auth: NatsAuth | None = None,
    inbox_prefix: str | None = None,
) -> None:
    """Connect, run the service, stop it on a signal and drain the connection. Once the
    service has started, the heap it was built with is frozen (freeze_startup_heap).

    A permission denial is fatal: the service stops and the process exits with status 2,
    naming the subject (a service that silently cannot publish would lie about the fleet).
    """
    try:
        nc = await connect(url, name=name, auth=auth, inbox_prefix=inbox_prefix)
    except PermissionError as e:
        log.error("%s", e)
        raise ServiceDenied(2) from None
    svc = make(nc)
    if isinstance(svc, Awaitable):
        svc = await svc
    denied: list[str] = []
    refused: list[RLBusError] = []
    running = anyio.CancelScope()

    def on_denied(action: str, subject: str) -> None:
        log.error(
            "%s: NATS denies %s to %s; check this service's credentials and role. Stopping.", name, action, subject
        )
        denied.append(subject)
        svc.stop()
        # whatever the service waits on (a JetStream call would only time out) ends now
        running.cancel()

    denials_of(nc).on_denied = on_denied
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for sig in signals:
                    log.info("%s: %s received, draining", name, signal.Signals(sig).name)
                    svc.stop()
                    return

        tg.start_soon(on_signal)
        with running:
            try:
                await svc.run(task_status=_Started(name))
            except RLBusError as e:  # refused to start (e.g. its worker id is taken): say why, exit 1
                if not denied:
                    log.error("%s: %s", name, e)
                refused.append(e)
        tg.cancel_scope.cancel()
    await drain(nc)
    if denied:
        raise ServiceDenied(2)
    if refused:
        raise ServiceRefused(1)
