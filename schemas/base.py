"""The one base every wire message derives from."""

from __future__ import annotations

import typing

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Frozen, keyword-only, tagged by an explicit snake_case ``kind``.

    Each subclass passes ``tag="..."`` so a class rename never changes the wire.
    New fields get defaults; existing field types never change.
    """


def op_of(message: type[Message] | Message) -> str:
    """The op a command type (or command) stands for: its wire tag, which is also the last
    token of its subject. Handlers are registered by type; the op comes from here."""
    cls = message if isinstance(message, type) else type(message)
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{cls.__name__} has no wire tag")
    return tag


def ops_of(union: object) -> tuple[str, ...]:
    """The ops of every member of a Union of command types, in declaration order."""
    return tuple(op_of(t) for t in typing.get_args(union))
