"""The trainer SDK: RLClient (async) and SyncRLClient (same methods, blocking)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from rlbus.connection import NatsAuth, connect, denials_of, drain, resolve_url
from rlbus.errors import (
    DeadlineExceeded,
    Internal,
    PermissionDenied,
    TransportError,
    Unavailable,
    from_nack,
)
from rlbus.schemas import (
    AnyCommand,
    FleetAck,
    GenerateReply,
    GenerateRequest,
    GetServerInfo,
    IsPaused,
    IsSleeping,
    Nack,
    Pause,
    PauseMode,
    Resume,
    ServerInfo,
    Sleep,
    SleepTag,
    Subjects,
    TransferInit,
    VersionInfo,
    WakeUp,
    encode,
    generate_reply_decoder,
    reply_decoder,
)
from rlbus.schemas.codec import DecodeError
from rlbus.updates import WeightUpdateCalls

if TYPE_CHECKING:
    import torch

    from rlbus.transfer.base import TrainerTransfer

T = TypeVar("T")
log = logging.getLogger("rlbus.client")



class RLClient(WeightUpdateCalls):
    """Talks to the controller over NATS. `async with await RLClient.connect(url) as rl: ...`"""

    def __init__(self, nc: Client, *, subjects: Subjects | None = None, timeout: float = 60.0, owns_connection: bool = False) -> None:
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.timeout = timeout
        """Deadline of one call; no call waits longer (a fan-out's own deadline is shorter)."""
        self._owns = owns_connection
        self._tx: TrainerTransfer | None = None
        self._init: TransferInit | None = None
        self._group: list[str] = []
        """Worker ids (rank order) the transfer group was built for."""
        self._scratch: list[torch.Tensor] = []
        self._scratch_of: object = None
        """update_weights' two packing buffers and the transfer group they belong to."""
        self._checksums: list[str] = []
        """Every bucket sent in the open session, in order (finish_weight_update carries them)."""
        self.bucket_bytes: int | None = None
        """Bucket size for update_weights (None: sized to the transport, see BUCKET_BYTES)."""

    @classmethod
    async def connect(
        cls, url: str | None = None, *, prefix: str = "rl", timeout: float = 60.0, auth: NatsAuth | None = None
    ) -> "RLClient":
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
        return cls(nc, subjects=Subjects(prefix=prefix), timeout=timeout, owns_connection=True)

    async def close(self) -> None:
        self._close_transfer()
        if self._owns:
            await drain(self.nc)

    async def __aenter__(self) -> "RLClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- transport ---------------------------------------------------------------------

    async def _call(self, command: AnyCommand, expect: type[T], timeout: float | None = None) -> T:
        op = type(command).__struct_config__.tag
        if not command.command_id:
            command = msgspec.structs.replace(command, command_id=uuid.uuid4().hex)
        t = timeout or self.timeout
        try:
            msg = await self._request(self.subjects.control(op), encode(command), t)
        except NoRespondersError:
            raise Unavailable("no controller is running (no responders); start one with `rlbus up` or `rlbus controller`") from None
        except (NatsTimeout, TimeoutError):
            raise DeadlineExceeded(f"the controller did not answer {op} within {t:g}s") from None
        return _decode(op, msg, expect)

    async def _request(self, subject: str, payload: bytes, timeout: float) -> Any:
        """nc.request, except that a permission denial for `subject` fails at once, loudly,
        instead of surfacing as a timeout (nats-py reports it only to its error callback)."""
        denials = denials_of(self.nc)
        outcome: list[Any] = []
        with denials.watch(subject) as denied:
            async with anyio.create_task_group() as tg:

                async def ask() -> None:
                    try:
                        outcome.append(await self.nc.request(subject, payload, timeout=timeout))
                    except Exception as e:  # noqa: BLE001
                        outcome.append(e)
                    tg.cancel_scope.cancel()

                async def refused() -> None:
                    await denied.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(ask)
                tg.start_soon(refused)
        if denied.is_set():
            raise PermissionDenied(f"the NATS server denies this identity publishing to {subject}; check its credentials and role")
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]

    # ---- fleet state -------------------------------------------------------------------

    async def server_info(self) -> ServerInfo:
        """Workers, their states and capabilities (AND-aggregated), the committed version."""
        return await self._call(GetServerInfo(), ServerInfo)

    async def pause(self, mode: PauseMode = "abort") -> FleetAck:
        """Pause generation everywhere. abort: end in-flight requests; wait: let them finish;
        keep: freeze them until resume. Idempotent."""
        return await self._call(Pause(mode=mode), FleetAck)

    async def resume(self) -> FleetAck:
        return await self._call(Resume(), FleetAck)

    async def is_paused(self) -> bool:
        """True when every worker is paused."""
        ack = await self._call(IsPaused(), FleetAck)
        return all(w.paused for w in ack.workers)

    async def sleep(self, level: int = 1, tags: Sequence[SleepTag] | None = None) -> FleetAck:
        """Free engine memory. level 1: weights to host backup + KV cache freed; level 2: weights
        discarded (push new ones after waking). tags: 'weights', 'kv_cache' (default both)."""
        return await self._call(Sleep(level=level, tags=list(tags) if tags is not None else None), FleetAck)  # type: ignore[arg-type]

    async def wake_up(self, tags: Sequence[SleepTag] | None = None) -> FleetAck:
        return await self._call(WakeUp(tags=list(tags) if tags is not None else None), FleetAck)

    async def is_sleeping(self) -> bool:
        """True while any worker has any part asleep."""
        ack = await self._call(IsSleeping(), FleetAck)
        return any(w.sleeping_tags for w in ack.workers)

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
            prompt_tokens=list(prompt_tokens), max_tokens=max_tokens, temperature=temperature, seed=seed, return_logprobs=return_logprobs
        )
        t = timeout or self.timeout
        try:
            msg = await self._request(self.subjects.generate, encode(req), t)
        except NoRespondersError:
            raise Unavailable("no worker serves generation (no responders)") from None
        except (NatsTimeout, TimeoutError):
            raise DeadlineExceeded(f"no generation reply within {t:g}s") from None
        return _decode("generate", msg, GenerateReply, generate_reply_decoder)


def _raise_for_service_error(op: str, msg: Any) -> None:
    headers = msg.headers or {}
    if "Nats-Service-Error-Code" in headers:
        raise TransportError(f"{op}: {headers.get('Nats-Service-Error', 'service error')} (code {headers['Nats-Service-Error-Code']})")


def _decode(op: str, msg: Any, expect: type[T], decoder: Any = reply_decoder) -> T:
    """The typed reply, or the exception for its Nack / service error."""
    _raise_for_service_error(op, msg)
    try:
        reply = decoder.decode(msg.data)
    except DecodeError as e:
        raise Internal(f"undecodable reply to {op}: {e}") from None
    if isinstance(reply, Nack):
        raise from_nack(reply)
    if not isinstance(reply, expect):
        raise Internal(f"{op}: expected {expect.__name__}, got {type(reply).__name__}")
    return reply


class SyncRLClient:
    """RLClient for trainers without an event loop: same methods, blocking.

    The NATS connection lives on a private event loop in a background thread.
    """

    def __init__(
        self, url: str | None = None, *, prefix: str = "rl", timeout: float = 60.0, auth: NatsAuth | None = None
    ) -> None:
        self._portal_cm = start_blocking_portal()
        self._portal: BlockingPortal = self._portal_cm.__enter__()
        try:
            self._client: RLClient = self._portal.call(
                lambda: RLClient.connect(url, prefix=prefix, timeout=timeout, auth=auth)
            )
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    @classmethod
    def connect(cls, url: str | None = None, **kw: Any) -> "SyncRLClient":
        return cls(url, **kw)

    def close(self) -> None:
        try:
            self._portal.call(self._client.close)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> "SyncRLClient":
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
            self._portal.call(agen.aclose)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._portal.call(lambda: attr(*args, **kwargs))

        call.__name__ = name
        call.__doc__ = attr.__doc__
        return call
