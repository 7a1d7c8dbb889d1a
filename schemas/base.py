"""The one base every wire message derives from."""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Frozen, keyword-only, tagged by an explicit snake_case ``kind``.

    Each subclass passes ``tag="..."`` so a class rename never changes the wire.
    New fields get defaults; existing field types never change.
    """
