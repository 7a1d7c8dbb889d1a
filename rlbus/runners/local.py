"""An in-process fleet (controller + workers on one event loop), for tests and notebooks.

Each service gets its own NATS connection, as separate processes would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from nats.aio.client import Client

from rlbus.bus.connection import connect, drain
from rlbus.services.controller.service import ControllerOptions, ControllerService
from rlbus.services.worker.engine import Engine
from rlbus.services.worker.service import WorkerOptions, WorkerService


class LocalFleet:
    def __init__(self, url: str) -> None:
        self.url = url
        self.controller: ControllerService | None = None
        self.workers: dict[str, WorkerService] = {}
        self._tasks: dict[object, asyncio.Task[None]] = {}
        self._conns: dict[object, Client] = {}

    async def start_controller(self, options: ControllerOptions | None = None) -> ControllerService:
        nc = await connect(self.url, name="rlbus-controller")
        svc = ControllerService(nc, options)
        await self._start(svc, nc)
        self.controller = svc
        return svc

    async def start_worker(self, engine: Engine, options: WorkerOptions) -> WorkerService:
        nc = await connect(
            self.url,
            name=f"rlbus-worker-{options.worker_id}",
            inbox_prefix=options.subjects.inbox(f"worker-{options.worker_id}"),
        )
        svc = WorkerService(nc, engine, options)
        await self._start(svc, nc)
        self.workers[options.worker_id] = svc
        return svc

    async def _start(self, svc: ControllerService | WorkerService, nc: Client) -> None:
        started = asyncio.get_running_loop().create_future()

        class _Status:
            def started(self, value: object = None) -> None:
                if not started.done():
                    started.set_result(None)

        task = asyncio.create_task(svc.run(task_status=_Status()))

        def settle(t: asyncio.Task) -> None:
            if not started.done():
                started.set_exception(t.exception() or RuntimeError("service exited"))

        task.add_done_callback(settle)
        await started
        self._tasks[svc] = task
        self._conns[svc] = nc

    async def stop(self, svc: ControllerService | WorkerService) -> None:
        """Stop one service the way SIGTERM would: drain, then close its connection."""
        svc.stop()
        await self._tasks.pop(svc)
        await drain(self._conns.pop(svc))
        if svc is self.controller:
            self.controller = None
        else:
            self.workers = {k: v for k, v in self.workers.items() if v is not svc}

    async def kill(self, svc: ControllerService | WorkerService) -> None:
        """Stop one service abruptly: its connection closes with no goodbye."""
        nc = self._conns.pop(svc)
        await nc.close()
        task = self._tasks.pop(svc)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        if svc is self.controller:
            self.controller = None
        else:
            self.workers = {k: v for k, v in self.workers.items() if v is not svc}

    async def close(self) -> None:
        for svc in list(self.workers.values()):
            await self.stop(svc)
        if self.controller is not None:
            await self.stop(self.controller)

    def all_running(self) -> bool:
        """True while no service started here has exited (stop() and kill() forget theirs)."""
        return all(not t.done() for t in self._tasks.values())

    async def wait_for_workers(self, ids: Sequence[str]) -> None:
        assert self.controller is not None
        await self.controller.wait_for(lambda reg: all(w in reg for w in ids))
