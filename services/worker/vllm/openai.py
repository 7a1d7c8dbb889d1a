"""vLLM's own OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, ...)
on the worker's AsyncLLM: `rlbus worker --engine vllm --openai-port P`.

It is vLLM's app (build_app + init_app_state), served by uvicorn inside the worker's event loop
(vLLM's NoSignalServer: rlbus's serve() owns SIGTERM and drains), with two things in front:

- the engine client vLLM's handlers see is VllmEngine.llm, except generate(): it passes rlbus's
  gate (VllmEngine.admitted, the one rl.generate passes), so an HTTP request is refused while the
  worker is withheld or its engine recovers (503), waits while the fleet is paused or a load runs,
  and counts in flight (a load waits for it, a pause drains it, a drain waits for it);
- a middleware stamps every response with the weights that produced it: `x-rlbus-weight-version`
  and `x-rlbus-weight-seq` (held when the request passed the gate), and, when the weights changed
  while it ran, `x-rlbus-weight-spans` (vLLM's own per-token WeightVersionSpan, with rlbus's seq);
  a stream, whose headers leave before its tokens, gets its spans as an SSE comment before
  `data: [DONE]`.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar
from http import HTTPStatus
from typing import Any

import anyio
from rlbus.schemas.errors import InvalidArgument, RLBusError, Unavailable

from .engine import VllmEngine

log = logging.getLogger("rlbus.worker.openai")

VERSION_HEADER = "x-rlbus-weight-version"
SEQ_HEADER = "x-rlbus-weight-seq"
SPANS_HEADER = "x-rlbus-weight-spans"


class _Served:
    """What served one HTTP request: the (version, seq) it was admitted on, and the spans of
    every sequence whose tokens came from more than that one version."""

    __slots__ = ("stamp", "spans", "prompts")

    def __init__(self) -> None:
        self.stamp: tuple[str, int] | None = None
        self.spans: list[dict[str, Any]] = []
        self.prompts = 0
        """generate() calls so far: the prompt's index in a multi-prompt completion."""

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.stamp is None:
            return []
        out = [(VERSION_HEADER.encode(), self.stamp[0].encode()), (SEQ_HEADER.encode(), str(self.stamp[1]).encode())]
        if self.spans:
            out.append((SPANS_HEADER.encode(), self._spans_json()))
        return out

    def _spans_json(self) -> bytes:
        return json.dumps(sorted(self.spans, key=lambda s: s["index"]), separators=(",", ":")).encode()

    def spans_comment(self) -> bytes:
        """A stream's headers leave before its tokens: its spans come last, as an SSE comment
        (`: x-rlbus-weight-spans [...]`) just before `data: [DONE]`; clients skip comments."""
        return b": " + SPANS_HEADER.encode() + b" " + self._spans_json() + b"\n\n"


_served: ContextVar[_Served | None] = ContextVar("rlbus_openai_served", default=None)


def http_error(e: RLBusError) -> Exception:
    """vLLM's exception that its handlers turn into an OpenAI-style error with this status."""
    from vllm.exceptions import GracefulHTTPError

    status = HTTPStatus.BAD_REQUEST if isinstance(e, InvalidArgument) else HTTPStatus.SERVICE_UNAVAILABLE
    if e.code not in ("INVALID_ARGUMENT", "UNAVAILABLE", "FAILED_PRECONDITION"):
        status = HTTPStatus.INTERNAL_SERVER_ERROR
    return GracefulHTTPError(e.message, status)


class GatedClient:
    """VllmEngine.llm as vLLM's OpenAI handlers see it. Every attribute is the live AsyncLLM's
    (looked up on each use: a recovery replaces it), except generate()."""

    def __init__(self, engine: VllmEngine, withheld: Callable[[], str | None]) -> None:
        self._engine = engine
        self._withheld = withheld
        self._seqs: dict[str, int] = {}
        """version -> the seq the worker held with it (vLLM's spans name versions only)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.llm, name)

    def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        served = _served.get()
        index = 0
        if served is not None:  # handlers call generate() once per prompt, in prompt order
            index, served.prompts = served.prompts, served.prompts + 1
        return self._generate(served, index, prompt, sampling_params, request_id, kwargs)

    def _held(self) -> tuple[str, int]:
        e = self._engine
        label = e.book.main
        self._seqs[label.version] = label.seq
        return label.version, label.seq

    def _refusal(self) -> RLBusError | None:
        why = self._withheld()
        return Unavailable(why) if why else None

    async def _generate(
        self, served: _Served | None, index: int, prompt: Any, params: Any, request_id: str, kwargs: dict[str, Any]
    ) -> AsyncIterator[Any]:
        engine = self._engine
        try:
            if (refused := self._refusal()) is not None:
                raise refused
            async with engine.admitted() as req:
                if (refused := self._refusal()) is not None:  # withheld while it waited for a resume
                    raise refused
                stamp = self._held()
                if served is not None and served.stamp is None:
                    served.stamp = stamp
                n = max(1, int(getattr(params, "n", 1) or 1))
                async for out in engine.llm.generate(prompt, params, request_id, **kwargs):
                    engine.started(req)
                    if out.finished:
                        self._held()
                        self._record_spans(served, stamp, index * n, out)
                    yield out
        except RLBusError as e:
            raise http_error(e) from None

    def _record_spans(self, served: _Served | None, stamp: tuple[str, int], first: int, out: Any) -> None:
        if served is None:
            return
        for seq_out in out.outputs:
            spans = seq_out.weight_versions or []
            if len(spans) <= 1 and all(s.version == stamp[0] for s in spans):
                continue  # every token came from the weights it was admitted on
            served.spans.append(
                {
                    "index": first + seq_out.index,
                    "spans": [[s.version, self._seqs.get(s.version), s.start, s.end] for s in spans],
                }
            )


class _Stamp:
    """ASGI middleware: the response's headers carry the weights that produced it. The start
    of the response is held until its first body chunk (a stream's comes after vLLM's first
    output), so the request has passed the gate by then."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served = _Served()
        token = _served.set(served)
        start: dict[str, Any] | None = None

        streaming = False

        async def stamped(message: dict[str, Any]) -> None:
            nonlocal start, streaming
            if message["type"] == "http.response.start":
                start = message
                streaming = any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
                )
                return
            if start is not None and message["type"] == "http.response.body":
                start = {**start, "headers": [*start.get("headers", []), *served.headers()]}
                await send(start)
                start = None
            if streaming and message["type"] == "http.response.body" and served.spans:
                body = message.get("body", b"")
                if body.startswith(b"data: [DONE]"):  # the stream's end: its spans, as an SSE comment
                    message = {**message, "body": served.spans_comment() + body}
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        finally:
            _served.reset(token)


def vllm_server_args(engine: VllmEngine, host: str, port: int, extra: list[str] | None = None) -> Any:
    """vLLM's own server arguments (make_arg_parser), for the model the engine serves."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            engine.options.model,
            "--served-model-name",
            engine.model_name,
            "--host",
            host,
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
            *(extra or []),
        ]
    )
    validate_parsed_serve_args(args)
    return args


class OpenAIServer:
    """vLLM's OpenAI-compatible server on a VllmEngine. Run with `await tg.start(server.run)`;
    `stop()` ends it gracefully (in-flight requests get `drain_timeout_s`)."""

    def __init__(
        self,
        engine: VllmEngine,
        withheld: Callable[[], str | None],
        *,
        host: str = "0.0.0.0",
        port: int = 8000,
        drain_timeout_s: float = 10.0,
    ) -> None:
        self.engine = engine
        self.client = GatedClient(engine, withheld)
        self.host = host
        self.port = port
        self.drain_timeout_s = drain_timeout_s
        self._server: Any = None
        self._stop = anyio.Event()

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.launcher import NoSignalServer

        if self.engine.llm.vllm_config.model_config.skip_tokenizer_init:
            raise Unavailable(
                "the OpenAI server needs vLLM's tokenizer: start vLLM without skip_tokenizer_init "
                "(a model folder with tokenizer files)"
            )
        sock = socket.create_server((self.host, self.port), reuse_port=False)
        self.port = sock.getsockname()[1]
        args = vllm_server_args(self.engine, self.host, self.port)
        tasks = await self.client.get_supported_tasks()
        app = build_app(args, tasks, self.client.model_config)
        await init_app_state(self.client, app.state, args, tasks)  # type: ignore[arg-type]
        config = uvicorn.Config(
            _Stamp(app),
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=max(1, int(self.drain_timeout_s)),
        )
        self._server = server = NoSignalServer(config)
        async with anyio.create_task_group() as tg:
            # the socket listens already: connections wait in its backlog until uvicorn accepts them
            tg.start_soon(server.serve, [sock])
            log.info("OpenAI API on http://%s:%d/v1 (model %s)", self.host, self.port, self.engine.model_name)
            task_status.started(self.port)
            await self._stop.wait()
            server.should_exit = True
        sock.close()

    def stop(self) -> None:
        self._stop.set()


def withheld_reason(worker: Any) -> Callable[[], str | None]:
    """Why a WorkerService takes no generation now (None: it does), as rl.generate refuses."""

    def why() -> str | None:
        if worker.book.withheld:
            return (
                f"worker {worker.id} is withheld from generation (not yet reconciled with the fleet, or behind "
                "the committed weights); retry, or send the request to another worker"
            )
        if worker.book.dirty:
            return (
                f"worker {worker.id} holds torn weights (an in-place update was aborted after bytes landed); "
                "it serves again once a push or a repair commits"
            )
        return None

    return why


class WithOpenAI:
    """A worker service with the OpenAI server beside it (the Service protocol serve() runs): the
    server starts once the worker runs, and stops on the worker's drain."""

    def __init__(self, worker: Any, server: OpenAIServer) -> None:
        self.worker = worker
        self.server = server

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        server = self.server

        class _WorkerStarted:
            def started(self, value: object = None) -> None:
                tg.start_soon(lambda: server.run(task_status=task_status))

        async with anyio.create_task_group() as tg:
            try:
                await self.worker.run(task_status=_WorkerStarted())
            finally:
                server.stop()

    def stop(self) -> None:
        self.server.stop()  # no new connections; in-flight requests finish (drain_timeout_s)
        self.worker.stop()
