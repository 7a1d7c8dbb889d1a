"""One way to open a NATS connection, for services, the SDK and the CLI: URL, credentials,
TLS, reconnects, and permission denials made loud."""

from __future__ import annotations

import logging
import os
import re
import ssl
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from rlbus.bus.replies import Call, Relinks, keep_relinks
from rlbus.schemas import PermissionDenied

log = logging.getLogger("rlbus.bus.connection")
QUIET_RECONNECT_S = 5.0
"""A reconnect after a longer outage logs at WARNING; shorter ones (and every disconnect) at DEBUG."""

DEFAULT_URL = "nats://127.0.0.1:4222"
URL_ENV = "RLBUS_NATS_URL"

_DENIED = re.compile(r'permissions violation for (publish|subscription) to "?([^"\s]+)"?', re.IGNORECASE)


def resolve_url(url: str | None) -> str | None:
    """The explicit URL, else $RLBUS_NATS_URL, else None (the caller decides: embedded server or
    error). Several servers (a cluster) are comma-separated: `nats://a:4222,nats://b:4222`."""
    return url or os.environ.get(URL_ENV) or None


class NatsAuth(msgspec.Struct, frozen=True, kw_only=True):
    """Credentials and TLS for one connection. Every field also reads from an env var."""

    user: str | None = None
    """$RLBUS_NATS_USER"""
    password: str | None = None
    """$RLBUS_NATS_PASSWORD"""
    creds: str | None = None
    """$RLBUS_NATS_CREDS: a .creds file (JWT + nkey seed)."""
    nkey: str | None = None
    """$RLBUS_NATS_NKEY: a file holding an nkey seed (needs the `nkeys` package)."""
    tls_ca: str | None = None
    """$RLBUS_NATS_TLS_CA: CA bundle to verify the server."""
    tls_cert: str | None = None
    """$RLBUS_NATS_TLS_CERT: client certificate (mutual TLS)."""
    tls_key: str | None = None
    """$RLBUS_NATS_TLS_KEY"""
    inbox: str | None = None
    """$RLBUS_NATS_INBOX: the reply-inbox prefix this identity may read (per role; `rlbus
    nats-config` writes it). None = nats-py's `_INBOX`."""

    @classmethod
    def from_env(cls, **given: str | None) -> NatsAuth:
        """Explicit values win; missing ones come from RLBUS_NATS_<FIELD>."""
        values = {f: given.get(f) or os.environ.get(f"RLBUS_NATS_{f.upper()}") or None for f in cls.__struct_fields__}
        return cls(**values)

    def connect_kwargs(self) -> dict[str, object]:
        kw: dict[str, object] = {}
        if self.user:
            kw["user"] = self.user
        if self.password:
            kw["password"] = self.password
        if self.creds:
            kw["user_credentials"] = self.creds
        if self.nkey:
            kw["nkeys_seed"] = self.nkey
        if self.tls_ca or self.tls_cert:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kw["tls"] = ctx
        return kw


REPLY_INBOX = "_inbox."
"""How reply subjects begin (nats-py's `_INBOX`, rlbus's per-role `_INBOX.<prefix>-<role>`,
the nats CLI's), lower-cased as nats-py reports denials."""


class Denials:
    """Permission violations the server reported on one connection.

    nats-py tells only its error callback; rlbus turns each into an error on the call that
    caused it (`watch(subject)`), or, for a service, into a fatal stop (`on_denied`) —
    except a denied reply (to a reply inbox): it concerns only the one who asked, typically a
    discovery request (`$SRV.PING` to all) from a role that may not hear every answer, and is
    logged; the requester times out. Whatever a service publishes on its own stays fatal.
    """

    def __init__(self) -> None:
        self._watchers: dict[str, list[_Watch]] = {}
        self.seen: list[tuple[str, str]] = []
        self.on_denied: Callable[[str, str], None] | None = None

    def report(self, action: str, subject: str) -> None:
        subject = subject.lower()  # nats-py lower-cases the server's error text
        self.seen.append((action, subject))
        for w in self._watchers.get(subject, []):
            w.event.set()
            w.scope.cancel()  # the call waiting on it stops at once
        if action == "publish" and subject.startswith(REPLY_INBOX):
            log.warning(
                "NATS denied a reply to %s (a discovery request to every service, say): that requester "
                "may not hear from this service; carrying on",
                subject,
            )
            return
        if self.on_denied is not None:
            self.on_denied(action, subject)

    def denied(self, subject: str) -> bool:
        return any(s == subject.lower() for _, s in self.seen)

    def watch(self, subject: str) -> _Watch:
        return _Watch(self, subject)


class _Watch:
    """A call on `subject` that a denial stops: `event` is set and `scope` (the call's) cancelled."""

    def __init__(self, denials: Denials, subject: str) -> None:
        self.denials, self.subject, self.event = denials, subject, anyio.Event()
        self.scope = anyio.CancelScope()

    def __enter__(self) -> _Watch:
        self.subject = self.subject.lower()
        self.denials._watchers.setdefault(self.subject, []).append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        lst = self.denials._watchers.get(self.subject, [])
        if self in lst:
            lst.remove(self)
        if not lst:
            self.denials._watchers.pop(self.subject, None)


_DENIALS: weakref.WeakKeyDictionary[Client, Denials] = weakref.WeakKeyDictionary()
"""rlbus's own record per connection (nothing is patched onto the library's client); an entry
goes with its connection."""


def denials_of(nc: Client) -> Denials:
    """The Denials record of a connection made by `connect` (an empty one otherwise)."""
    d = _DENIALS.get(nc)
    if d is None:
        d = _DENIALS[nc] = Denials()
    return d


async def connect(
    url: str,
    *,
    name: str,
    auth: NatsAuth | None = None,
    ping_interval: float = 2.0,
    max_outstanding_pings: int = 2,
    inbox_prefix: str | None = None,
) -> Client:
    """Connect with reconnects forever and a short ping interval (a dead link shows within
    seconds). Credentials come from `auth`, else from the RLBUS_NATS_* environment."""
    auth = auth or NatsAuth.from_env()
    denials = Denials()
    relinks = Relinks()
    refused = anyio.Event()
    reason: list[Exception] = []
    connected = False

    async def on_error(e: Exception) -> None:
        m = _DENIED.search(str(e))
        if m:
            log.error("%s: NATS denied %s to %s", name, m.group(1), m.group(2))
            denials.report(m.group(1).lower(), m.group(2))
        elif not connected and ("authorization" in str(e).lower() or isinstance(e, ssl.SSLError)):
            # wrong credentials or an untrusted certificate: fail the connect, don't retry forever
            reason.append(e)
            refused.set()
        else:
            log.warning("%s: NATS error: %s", name, e)

    down: list[float] = []

    async def on_disconnect() -> None:
        # closing ends in a disconnect too; a reconnect within seconds is routine (a node
        # restart, a failover): loud only when it lasts (on_reconnect) or fails (on_error)
        down[:] = [time.monotonic()]
        log.debug("%s: disconnected from NATS", name)

    async def on_reconnect() -> None:
        gone = time.monotonic() - down[0] if down else 0.0
        relinks.happened()
        log.log(
            logging.WARNING if gone > QUIET_RECONNECT_S else logging.DEBUG,
            "%s: reconnected to NATS after %.1fs",
            name,
            gone,
        )

    result: list[Client] = []

    async def attempt() -> None:
        result.append(
            await _connect(
                url,
                name,
                ping_interval,
                max_outstanding_pings,
                auth,
                on_error,
                on_disconnect,
                on_reconnect,
                inbox_prefix,
            )
        )
        tg.cancel_scope.cancel()

    async def watch_refusal() -> None:
        await refused.wait()
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(attempt)
        tg.start_soon(watch_refusal)
    if not result:
        if reason and isinstance(reason[0], ssl.SSLError):
            raise PermissionError(f"{name}: TLS with NATS at {url} failed: {reason[0]} (check --nats-tls-ca)")
        raise PermissionError(f"{name}: NATS at {url} refused the credentials (Authorization Violation)")
    nc = result[0]
    connected = True
    _DENIALS[nc] = denials
    keep_relinks(nc, relinks)
    return nc


async def _connect(
    url, name, ping_interval, max_outstanding_pings, auth, on_error, on_disconnect, on_reconnect, inbox_prefix
) -> Client:
    inbox_prefix = inbox_prefix or auth.inbox
    extra = {"inbox_prefix": inbox_prefix} if inbox_prefix else {}
    return await nats.connect(
        [u.strip() for u in url.split(",") if u.strip()],  # a cluster: any node will do, reconnects to any
        name=name,
        ping_interval=ping_interval,
        max_outstanding_pings=max_outstanding_pings,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        **auth.connect_kwargs(),  # type: ignore[arg-type]
        **extra,
    )


async def drain(nc: Client, timeout: float = 5.0) -> None:
    """Drain (in-flight messages finish) and close; a connection that cannot drain (closed,
    reconnecting) is just closed. Never raises, never waits longer than `timeout`."""
    if nc.is_closed:
        return
    with anyio.move_on_after(timeout, shield=True):
        try:
            await nc.drain()
            return
        except Exception as e:  # reconnecting, already closing...
            log.debug("drain failed (%s); closing", e)
    try:
        await nc.close()
    except Exception as e:
        log.debug("close failed: %s", e)


async def stop_service(svc: Any, timeout: float = 2.0) -> None:
    """Stop a nats.micro service, also on a link that is down (a process thawed from a freeze,
    NATS away). micro's stop() unsubscribes the endpoints, then drains the discovery
    subscriptions with a round trip that fails on a dead link, and would leave them registered:
    the client would subscribe them again on reconnect and `$SRV` would list a service that
    takes nothing. What stop() left is dropped from the client here. Never raises."""
    try:
        with anyio.fail_after(timeout):
            await svc.stop()
        return
    except Exception as e:  # flush timeout, connection closed or reconnecting
        log.debug("stopping service %s on a dead link (%s); dropping its subscriptions", svc.info().name, e)
    subs = [*svc._subscriptions.values(), *(ep._subscription for ep in svc._endpoints if ep._subscription)]
    for sub in subs:  # nats.micro keeps no other handle on them
        svc._client._remove_sub(sub._id)
    svc._subscriptions = {}
    svc._endpoints = []
    svc._stopped.set()


async def request(nc: Client, subject: str, payload: bytes, timeout: float, call: Call | None = None) -> Msg:
    """nc.request, except that a permission denial for `subject` fails at once, loudly, with
    PermissionDenied, instead of surfacing as a timeout (nats-py reports a denial only to
    its error callback). With `call`, one send of that call (bus/replies.py: an answer to any
    earlier send of it counts)."""
    denials = denials_of(nc)
    inbox = _inbox_denied(nc)
    if inbox:
        raise PermissionDenied(inbox)
    outcome: list[Msg | Exception] = []
    with denials.watch(subject) as watch, watch.scope:  # a denial cancels the scope: no task to wait on it
        try:
            if call is None:
                outcome.append(await nc.request(subject, payload, timeout=timeout))
            else:
                outcome.append(await call.ask(subject, payload, timeout))
        except Exception as e:
            outcome.append(e)
    if watch.event.is_set():
        raise PermissionDenied(
            f"the NATS server denies this identity publishing to {subject}; check its credentials and role"
        )
    if isinstance(outcome[0], Exception):
        inbox = _inbox_denied(nc)
        if inbox:  # the replies could never arrive: say why instead of timing out
            raise PermissionDenied(inbox)
        raise outcome[0]
    return outcome[0]


def _inbox_denied(nc: Client) -> str | None:
    """Why replies cannot reach this connection: the server denied it its reply inbox."""
    raw = getattr(nc, "_inbox_prefix", b"_INBOX")  # nats-py keeps it as bytes
    prefix = bytes(raw).decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    for action, s in denials_of(nc).seen:
        if action == "subscription" and s.startswith(prefix.lower()):
            return (
                f"the NATS server denies this identity its reply inbox {prefix}.>; set RLBUS_NATS_INBOX "
                "(NatsAuth.inbox) to the prefix its config allows (`rlbus nats-config` writes it in the env file)"
            )
    return None
