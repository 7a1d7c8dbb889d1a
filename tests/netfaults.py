"""Network faults for tests (not a test file): a TCP proxy that can blackhole or slow a link."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Blackhole:
    """A TCP proxy to the server that can swallow every byte both ways while keeping the
    sockets open: a silent link, as a dead host or a dropped route looks, without root. With
    `delay_s`, what the server sends reaches the client that much later (a slow link)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.holed = False
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.delay_s = 0.0
        self.tripwire: tuple[bytes, Callable[[], None]] | None = None
        """(pattern, act): the first bytes from the server that contain `pattern` run `act`
        before they are passed on (a signal to the client the moment a command reaches it)."""
        self.swallowed = bytearray()
        """What the server sent that the hole swallowed (the last 64 KiB)."""

    async def __aenter__(self) -> Blackhole:
        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()

    def cut(self) -> None:
        """Close every link through the proxy now (a reset, as a node that died): its clients
        see the link close and reconnect, through the proxy again."""
        for w in self._writers:
            w.close()
        self._writers = []

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:  # nothing listens there (yet): the client sees the link close
            writer.close()
            return
        self._writers += [writer, up_writer]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, down: bool = False) -> None:
            try:
                while data := await r.read(65536):
                    if down and self.tripwire is not None and self.tripwire[0] in data:
                        act, self.tripwire = self.tripwire[1], None
                        act()
                    if down and self.delay_s:
                        await asyncio.sleep(self.delay_s)  # the link's latency, not a wait for a condition
                    if not self.holed:
                        w.write(data)
                        await w.drain()
                    elif down:
                        self.swallowed = (self.swallowed + data)[-65536:]
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer, down=True))
