"""The rlbus worker's side of the bytes that land in vLLM's worker processes (extension.py).

An EngineReceiver: WeightUpdates keeps the session and checks every update's metadata against
the checkpoint before a byte moves, then hands the data plane here, and this drives the
`rlbus_*` methods of every vLLM worker process with `AsyncLLM.collective_rpc`. Those return at
once (their work runs in threads there, so vLLM's engine keeps stepping); this awaits each job
by polling it: a few milliseconds at first, then at most every POLL_MAX_S.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
from rlbus.schemas import BucketMeta, ParamMeta, TensorChecksum, TransferInit, UpdateTarget
from rlbus.schemas.errors import Unavailable

from rlbus.transfer.base import TransferError

log = logging.getLogger("rlbus.worker.vllm")

POLL_FIRST_S = 0.0005
POLL_MAX_S = 0.005
"""A job's poll interval doubles from POLL_FIRST_S up to this (a poll costs vLLM one RPC)."""

_encode = msgspec.msgpack.encode


class _Host(Protocol):
    """The adapter (engine.py) as this sees it."""

    llm: Any
    options: Any
    """The engine's VllmOptions (its `staging`)."""
    launches: int
    """vLLM starts so far: a restarted vLLM's workers are in no group."""

    async def load_received(
        self, target: UpdateTarget, session_id: str, version: str | None, loaded: Callable[[], None]
    ) -> None: ...


class VllmReceiver:
    def __init__(self, engine: _Host) -> None:
        self._engine = engine
        self._order = asyncio.Lock()  # calls reach vLLM's workers in the order they were made
        self._keys = itertools.count()
        self._background: set[asyncio.Task[None]] = set()
        self._joined: tuple[str, int] | None = None
        """The group vLLM's workers joined, and in which of vLLM's starts."""

    async def _call(self, method: str, *args: Any) -> list[Any]:
        """One call on every vLLM worker process; their answers, by rank."""
        async with self._order:
            try:
                return list(await self._engine.llm.collective_rpc(method, args=args))
            except Unavailable:
                raise
            except Exception as e:
                raise TransferError(f"vLLM's worker failed {method}: {type(e).__name__}: {e}") from e

    async def _job(self, method: str, *args: Any) -> list[Any]:
        """Start a job on every vLLM worker process and await all of them; their results."""
        key = f"{method}-{next(self._keys)}"
        await self._call(method, key, *args)
        delay = POLL_FIRST_S
        while True:
            polls = await self._call("rlbus_poll", key)
            if all(done for done, _, _ in polls):
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
        errors = [error for _, error, _ in polls if error]
        if errors:
            raise TransferError(errors[0])
        return [result for _, _, result in polls]

    def _later(self, method: str, *args: Any) -> None:
        """A call that must not wait (abort, leave): sent in order, its failure logged."""

        async def call() -> None:
            try:
                await self._call(method, *args)
            except Exception as e:
                log.warning("vLLM's worker did not take %s: %s", method, e)

        task = asyncio.get_running_loop().create_task(call())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- EngineReceiver ------------------------------------------------------------------

    async def live_digest(self, target: UpdateTarget) -> str:
        """One hash over every vLLM worker process's hash of its live model, by rank."""
        digests = await self._job("rlbus_live_digest", target)
        return digests[0] if len(digests) == 1 else _combine(digests)

    async def join(self, init: TransferInit, rank: int) -> None:
        self._joined = None
        await self._job("rlbus_join", _encode(init), rank)
        self._joined = (init.group_name, self._engine.launches)

    def leave(self, group_name: str) -> None:
        if self._joined is not None and self._joined[0] == group_name:
            self._joined = None
        self._later("rlbus_leave", group_name)

    def holds(self, group_name: str) -> bool:
        return self._joined == (group_name, self._engine.launches)

    async def receive(
        self,
        session_id: str,
        target: UpdateTarget,
        params: Sequence[ParamMeta],
        buckets: Sequence[BucketMeta],
        *,
        in_place: bool = False,
    ) -> None:
        await self._job(
            "rlbus_receive",
            session_id,
            target,
            _encode(list(params)),
            _encode(list(buckets)),
            in_place,
            self._engine.options.staging,
        )

    async def verify(
        self, session_id: str, checksums: Sequence[str], tensor_checksums: Sequence[TensorChecksum]
    ) -> str | None:
        problems = await self._job("rlbus_verify", session_id, list(checksums), _encode(list(tensor_checksums)))
        return next((p for p in problems if p), None)

    async def commit(
        self, session_id: str, target: UpdateTarget, version: str | None, loaded: Callable[[], None]
    ) -> None:
        await self._engine.load_received(target, session_id, version, loaded)

    def abort(self, session_id: str) -> None:
        self._later("rlbus_abort", session_id)


def _combine(digests: Sequence[str]) -> str:
    import hashlib

    return hashlib.blake2b("\n".join(digests).encode(), digest_size=16).hexdigest()
