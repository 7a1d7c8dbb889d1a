"""A call's one reply subject, kept across its resends.

nats-py's request gives every send a reply subject of its own and forgets it when that send
times out. A control command is resent under the same id when an attempt goes unanswered, and
the controller answers each send on the reply subject it came with: an answer that took longer
than one attempt (a state store riding out a node loss for 15 s, against the SDK's 5 s
attempts) reached a subject nobody listened on any more, and the resend that waited behind it
started the wait over. Here a call keeps one reply subject for all of its sends, on one wildcard
subscription per connection (as nats-py's own request mux), and the first answer to any of them
is the answer: they all carry one command id, which runs once."""

from __future__ import annotations

import asyncio
import secrets

import nats.errors
import nats.js.api
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rlbus.schemas import FIRST_SEND_HEADER

_FIRST = {FIRST_SEND_HEADER: "1"}


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

    def call(self, fresh: bool = False) -> Call:
        """A call: send it as often as it takes with `ask`; close it when done. `fresh`: its
        command's id was made for this call (its first send says so, FIRST_SEND_HEADER)."""
        call = Call(self, secrets.token_hex(8), fresh)
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

    def __init__(self, inbox: ReplyInbox, token: str, fresh: bool = False) -> None:
        self._inbox = inbox
        self.token = token
        self._answer: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self.sent = 0
        self.fresh = fresh
        """Its command's id was made for this call: the first send carries FIRST_SEND_HEADER."""

    def arrived(self, msg: Msg) -> None:
        """An answer to one of this call's sends. A real one replaces a no-responders that an
        earlier send got (the service came up meanwhile); the first real one stands."""
        if not self._answer.done():
            self._answer.set_result(msg)
        elif _nobody(self._answer.result()) and not _nobody(msg):
            self._answer = asyncio.get_running_loop().create_future()
            self._answer.set_result(msg)

    async def ask(self, subject: str, payload: bytes, timeout: float) -> Msg:
        """The answer to this call: one that arrived since the last send returns at once;
        otherwise send once more and wait up to `timeout` for an answer to this send or any
        before it. Raises as nats-py's request does: NoRespondersError, TimeoutError. The first
        send of a fresh call says it is one (FIRST_SEND_HEADER)."""
        if self._answer.done():
            if not _nobody(self._answer.result()):
                return self._answer.result()
            self._answer = asyncio.get_running_loop().create_future()  # that no-responders is spent
        answer = self._answer
        prefix = await self._inbox._open()
        first = _FIRST if self.fresh and self.sent == 0 else None
        self.sent += 1
        await self._inbox.nc.publish(subject, payload, reply=prefix + self.token, headers=first)
        # asyncio.wait leaves the answer's future alone when it times out: a later send shares it
        await asyncio.wait((answer,), timeout=timeout)
        if not answer.done():
            raise nats.errors.TimeoutError
        msg = answer.result()
        if _nobody(msg):
            raise nats.errors.NoRespondersError
        return msg

    def close(self) -> None:
        self._inbox._calls.pop(self.token, None)
