"""Encoders and decoders, built once. JSON so `nats req` can talk to rlbus by hand."""

from __future__ import annotations

import re
import typing
from typing import Union

import msgspec

from .base import op_of
from .events import AnyEvent
from .generate import GenerateReply, GenerateRequest
from .replies import AnyReply, Nack, VersionInfo

_encoder = msgspec.json.Encoder()
encode = _encoder.encode

reply_decoder = msgspec.json.Decoder(AnyReply)
event_decoder = msgspec.json.Decoder(AnyEvent)
generate_request_decoder = msgspec.json.Decoder(GenerateRequest)
generate_reply_decoder = msgspec.json.Decoder(Union[GenerateReply, Nack])
version_decoder = msgspec.json.Decoder(VersionInfo)
"""The committed-version record, as the state KV holds it and rl.version carries it."""

DecodeError = msgspec.DecodeError
ValidationError = msgspec.ValidationError


_AT = re.compile(r" - at `\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*)`$")


def error_path(error: msgspec.ValidationError) -> str:
    """Where a validation error is: `""` for the payload itself (not an object, a required
    field missing), `".mode"`, `".params[0].dtype"`..."""
    m = _AT.search(str(error))
    return m.group(1) if m else ""


def invalid_field(kind: type[msgspec.Struct], error: msgspec.ValidationError) -> str:
    """A refusal for a payload of the right kind whose field holds a wrong value: names the
    field and, where its type is a set of values (a Literal), every value it allows."""
    text = str(error)
    m = _AT.search(text)
    if m is None:
        return f"invalid {op_of(kind)} payload: {text}"  # type: ignore[arg-type]
    path = m.group(1)
    field_type: object = kind
    for name in re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)", path):
        hints = typing.get_type_hints(_struct_of(field_type)) if _struct_of(field_type) else {}
        field_type = hints.get(name)
    allowed = _literal_values(field_type)
    problem = text[: m.start()]
    where = path.lstrip(".") or "payload"
    if allowed:
        return f"{op_of(kind)}: {where}: {problem}; allowed values: {', '.join(repr(v) for v in allowed)}"  # type: ignore[arg-type]
    return f"{op_of(kind)}: {where}: {problem}"  # type: ignore[arg-type]


def _struct_of(t: object) -> type[msgspec.Struct] | None:
    for candidate in (t, *typing.get_args(t)):
        if isinstance(candidate, type) and issubclass(candidate, msgspec.Struct):
            return candidate
    return None


def _literal_values(t: object) -> tuple[object, ...]:
    if typing.get_origin(t) is typing.Literal:
        return typing.get_args(t)
    for arg in typing.get_args(t):  # Optional[...], list[...]
        if values := _literal_values(arg):
            return values
    return ()
