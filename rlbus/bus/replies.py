"""A call's one reply subject, kept across its resends.

nats-py's request gives every send a reply subject of its own and forgets it when that send
times out. A control command is resent under the same id when an attempt goes unanswered, and
the controller answers each send on the reply subject it came with: an answer that took longer
than one attempt (a state store riding out a node loss for 15 s, against the SDK's 5 s
attempts) reached a subject nobody listened on any more, and the resend that waited behind it
started the wait over. Here a call keeps one reply subject for all of its sends, on one wildcard
subscription per connection (as nats-py's own request mux), and the first answer to any of them
is the answer: they all carry one command id, which runs once.

A reply sent while the caller's link was down is lost (NATS drops what reaches no subscriber),
so a call also sends again after each reconnect of its connection: a command answers from its
id's first run; a generation goes to the worker that took it (which said so, RESEND_TO_HEADER)
and answers from its run, or, when that word was lost too, through the queue group (another
worker would run it afresh). Seen on a loaded host: nats-server answered no PING for 5-10 s
(one of its threads in fsync, the others waiting for a core), every client reconnected, and
two replies a worker sent in those 10 ms before the caller's subscription was back were gone:
the call waited out its 300 s. A reply can also be lost with no reconnect of the caller's
own (on the worker's link, closed by the server while it was silent), so a call told where to
send again also asks there from time to time while no answer came: REASK_S after a send, then
twice as long each time, up to REASK_MAX times that; the worker answers with a word (the run is still
under way) or with the finished run's reply. A worker that stops hands back a generate it holds
and has not started (HANDED_BACK_HEADER): the call sends it through the queue group at once."""

from __future__ import annotations

import asyncio
import secrets
import weakref

import nats.errors
import nats.js.api
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rlbus.schemas import FIRST_SEND_HEADER, HANDED_BACK_HEADER, RESEND_TO_HEADER, SENDS_AGAIN_HEADER

_FIRST = {FIRST_SEND_HEADER: "1"}

REASK_S = 10.0
"""A call told where to send again (a generate) asks there this long after its last send, when
no answer came: a reply lost with no reconnect of the caller's costs it this, not its deadline."""

REASK_MAX = 6
"""The longest gap between such asks, in first gaps (each doubles the last, so 10 s, 20, 40,
then every 60 s): a long generate is asked a few times, and each ask sends its bytes again."""


class Relinks:
    """A connection's reconnects. NATS drops a message that reaches no subscriber, and while a
    link is down its subscriptions are gone from the server: a reply sent then is lost, and a
    call waiting for it sends again once the link is back (Call.ask)."""

    def __init__(self) -> None:
        self.count = 0
        self._next: asyncio.Future[None] | None = None

    def next(self) -> asyncio.Future[None]:
        """Done at the next reconnect (its subscriptions are back on the server by then)."""
        if self._next is None or self._next.done():
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    def happened(self) -> None:
        self.count += 1
        if self._next is not None and not self._next.done():
            self._next.set_result(None)


_RELINKS: weakref.WeakKeyDictionary[Client, Relinks] = weakref.WeakKeyDictionary()


def keep_relinks(nc: Client, relinks: Relinks) -> None:
    """The record `connect` keeps of `nc`'s reconnects."""
    _RELINKS[nc] = relinks


def relinks_of(nc: Client) -> Relinks:
    """The Relinks record of a connection made by bus.connection.connect (one that never fires otherwise)."""
    r = _RELINKS.get(nc)
    if r is None:
        r = _RELINKS[nc] = Relinks()
    return r


class ReplyInbox:
    """One connection's answers to its calls, routed by the last token of the reply subject."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._opening = asyncio.Lock()
        self._calls: dict[str, Call] = {}

    async def _open(self) -> str:
        """The prefix of this connection's reply subjects (subscribed on first use)."""
        if self._sub is None:
            async with self._opening:
                if self._sub is None:
                    # under the connection's inbox prefix: the permissions its identity has apply
                    prefix = self.nc.new_inbox() + "."
                    self._sub = await self.nc.subscribe(prefix + "*", cb=self._on_reply)
                    self._prefix = prefix
        return self._prefix

    async def _on_reply(self, msg: Msg) -> None:
        call = self._calls.get(msg.subject[len(self._prefix) :])
        if call is not None:
            call.arrived(msg)

    def call(self, fresh: bool = False, redirects: bool = False, reask_s: float = REASK_S) -> Call:
        """A call: send it as often as it takes with `ask`; close it when done. `fresh`: its
        command's id was made for this call (its first send says so, FIRST_SEND_HEADER).
        `redirects`: its sends ask the service that takes it where to send again
        (SENDS_AGAIN_HEADER; a generate), and it asks there again from `reask_s` after its last
        send while no answer came."""
        call = Call(self, secrets.token_hex(8), fresh, redirects, reask_s)
        self._calls[call.token] = call
        return call

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception:  # closing or reconnecting: the connection drops it anyway
                pass


def _nobody(msg: Msg) -> bool:
    """The server's own answer that no subscriber took the send (status 503)."""
    return bool(msg.headers) and msg.headers.get(nats.js.api.Header.STATUS) == NO_RESPONDERS_STATUS  # type: ignore[union-attr]


class Call:
    """The sends of one command, answered on one reply subject."""

    def __init__(
        self, inbox: ReplyInbox, token: str, fresh: bool = False, redirects: bool = False, reask_s: float = REASK_S
    ) -> None:
        self._inbox = inbox
        self.token = token
        self._answer: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self.sent = 0
        self.fresh = fresh
        """Its command's id was made for this call: the first send carries FIRST_SEND_HEADER."""
        self._headers = {SENDS_AGAIN_HEADER: "1"} if redirects else None
        """Every send's headers (a first send adds FIRST_SEND_HEADER)."""
        self.resend_to: str | None = None
        """Where a send after a reconnect goes, when the service that took the call said
        (RESEND_TO_HEADER): the worker running a generate, not the queue group."""
        self.reask_s = reask_s
        """While resend_to is known and no answer came: the gap before it is asked again (doubled
        each time, up to REASK_MAX times this)."""
        self.handed_back = 0
        """Times a worker handed the call back: the first is sent on at once, later ones after a
        growing pause (a worker that left the queue group may still get a send or two)."""
        self._back: asyncio.Future[None] | None = None
        """Set when the worker that held the call handed it back, not started (HANDED_BACK_HEADER):
        the waiting ask sends it through the queue group again at once."""

    def arrived(self, msg: Msg) -> None:
        """An answer to one of this call's sends. A real one replaces a no-responders that an
        earlier send got (the service came up meanwhile); the first real one stands. A word of
        where to send again is kept, and answers nothing; a no-responders forgets it (the
        worker that took the call is gone). A hand-back (the worker stops, and did not start it)
        forgets it too, and has the waiting ask send through the queue group at once."""
        if msg.headers and RESEND_TO_HEADER in msg.headers:
            self.resend_to = msg.headers[RESEND_TO_HEADER]
            return
        if msg.headers and HANDED_BACK_HEADER in msg.headers:
            self.resend_to = None
            if self._back is not None and not self._back.done():
                self._back.set_result(None)
            return
        if _nobody(msg):
            self.resend_to = None
        if not self._answer.done():
            self._answer.set_result(msg)
        elif _nobody(self._answer.result()) and not _nobody(msg):
            self._answer = asyncio.get_running_loop().create_future()
            self._answer.set_result(msg)

    async def ask(self, subject: str, payload: bytes, timeout: float) -> Msg:
        """The answer to this call: one that arrived since the last send returns at once;
        otherwise send once more and wait up to `timeout` for an answer to this send or any
        before it, sending again after each reconnect of the connection meanwhile (a reply sent
        while the link was down is lost; to `resend_to` when the service named it, and where it
        was sent first when that one is gone), and to `resend_to` after each `reask_s` gap (a
        reply lost with no reconnect of this link's). Raises as nats-py's request does:
        NoRespondersError, TimeoutError. The first send of a fresh call says it is one
        (FIRST_SEND_HEADER)."""
        if self._answer.done():
            if not _nobody(self._answer.result()):
                return self._answer.result()
            self._answer = asyncio.get_running_loop().create_future()  # that no-responders is spent
        answer = self._answer
        prefix = await self._inbox._open()
        headers = {**_FIRST, **(self._headers or {})} if self.fresh and self.sent == 0 else self._headers
        self.sent += 1
        nc = self._inbox.nc
        await nc.publish(subject, payload, reply=prefix + self.token, headers=headers)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        relinks = relinks_of(nc)
        redirected = False  # the last send went to resend_to
        redirecting, gap, asked = self._headers is not None, self.reask_s, loop.time()
        back = self._back = loop.create_future()
        while True:
            while not answer.done() and (left := end - loop.time()) > 0:
                relinked = relinks.next()
                wait = max(0.0, min(left, asked + gap - loop.time())) if redirecting else left
                # asyncio.wait leaves the futures alone when it returns: a later send shares the answer
                await asyncio.wait((answer, relinked, back), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if answer.done():
                    break
                if back.done():  # handed back, not started: through the queue group, now
                    back = self._back = loop.create_future()
                    self.handed_back += 1
                    if self.handed_back > 1:  # back-off between retries (a worker still leaving the group)
                        await asyncio.sleep(min(0.05 * 2 ** (self.handed_back - 2), 0.5, max(0.0, end - loop.time())))
                    self.sent += 1
                    redirected, asked = False, loop.time()
                    await nc.publish(subject, payload, reply=prefix + self.token, headers=self._headers)
                    continue
                # a reply sent while the link was down is lost; one lost on the far side leaves
                # nothing to notice but the time
                now = loop.time()
                due = redirecting and now >= asked + gap
                if due:  # asked where it runs only: never through the queue group again
                    asked = now
                reask = due and self.resend_to is not None
                if reask:
                    gap = min(2 * gap, REASK_MAX * self.reask_s)
                if relinked.done() or reask:
                    self.sent += 1
                    redirected = self.resend_to is not None
                    asked = now
                    await nc.publish(
                        self.resend_to or subject, payload, reply=prefix + self.token, headers=self._headers
                    )
            if redirected and answer is self._answer and answer.done() and _nobody(answer.result()):
                # the service that took the call is gone (arrived() forgot it): where it was sent first
                redirected = False
                answer = self._answer = loop.create_future()
                self.sent += 1
                await nc.publish(subject, payload, reply=prefix + self.token, headers=self._headers)
                continue
            break
        if not answer.done():
            raise nats.errors.TimeoutError
        msg = answer.result()
        if _nobody(msg):
            raise nats.errors.NoRespondersError
        return msg

    def close(self) -> None:
        self._inbox._calls.pop(self.token, None)
