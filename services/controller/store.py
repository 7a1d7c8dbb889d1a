"""Durable controller state in a JetStream KV bucket: epoch, committed versions, open session.

Keys (schemas.subjects.KvKey): the epoch (fencing counter, advanced with revision checks),
the committed version (a VersionInfo), the open session id (or empty).
"""

from __future__ import annotations

import hashlib
import logging

import msgspec
from nats.aio.client import Client
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from rlbus.schemas import DEFAULT_VERSION, FleetState, KvKey, VersionInfo, encode, version_decoder
from rlbus.services.endpoints import StoredReply

log = logging.getLogger("rlbus.controller.store")


class StateStore:
    """The controller's durable state. Every write is a JetStream KV put (file storage)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, nc: Client, bucket: str) -> "StateStore":
        js = nc.jetstream()
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=16, storage=StorageType.FILE, description="rlbus controller state")
            )
        return cls(kv)

    async def _get(self, key: str) -> tuple[bytes | None, int]:
        try:
            e = await self.kv.get(key)
        except KeyNotFoundError:
            return None, 0
        return e.value, e.revision or 0

    async def take_epoch(self) -> int:
        """Advance the epoch by one with a revision check; two controllers never share one."""
        while True:
            raw, rev = await self._get(KvKey.EPOCH)
            new = (int(raw) if raw else 0) + 1
            try:
                if rev:
                    await self.kv.update(KvKey.EPOCH, str(new).encode(), last=rev)
                else:
                    await self.kv.create(KvKey.EPOCH, str(new).encode())
                return new
            except (KeyWrongLastSequenceError, Exception) as e:  # lost the race: read again
                if not _is_wrong_sequence(e):
                    raise

    async def version(self) -> VersionInfo:
        raw, _ = await self._get(KvKey.VERSION)
        return version_decoder.decode(raw) if raw else VersionInfo(version=DEFAULT_VERSION)

    async def put_version(self, info: VersionInfo) -> None:
        await self.kv.put(KvKey.VERSION, encode(info))

    async def committed_seq(self, version: str) -> int | None:
        """The sequence a version string was committed with, if it ever was (unique_versions)."""
        raw, _ = await self._get(_committed_key(version))
        return int(raw) if raw else None

    async def put_committed(self, version: str, seq: int) -> None:
        await self.kv.put(_committed_key(version), str(seq).encode())

    async def desired(self) -> FleetState:
        raw, _ = await self._get(KvKey.DESIRED)
        return _desired.decode(raw) if raw else FleetState()

    async def put_desired(self, state: FleetState) -> None:
        await self.kv.put(KvKey.DESIRED, encode(state))

    async def session(self) -> str | None:
        raw, _ = await self._get(KvKey.SESSION)
        return raw.decode() if raw else None

    async def put_session(self, session_id: str | None) -> None:
        await self.kv.put(KvKey.SESSION, (session_id or "").encode())


def _committed_key(version: str) -> str:
    return f"{KvKey.COMMITTED}.{hashlib.blake2b(version.encode(), digest_size=16).hexdigest()}"


def _is_wrong_sequence(e: Exception) -> bool:
    return isinstance(e, KeyWrongLastSequenceError) or "wrong last sequence" in str(e).lower()


class ReplyStore:
    """Answers of state-changing commands by command id, in a KV bucket whose entries expire
    after `ttl_s`: a trainer that retries a command after a controller restart gets the first
    answer instead of running it twice. Best effort: a store that cannot be reached costs
    the durability of that answer, never the answer itself."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    @classmethod
    async def open(cls, nc: Client, bucket: str, ttl_s: float) -> "ReplyStore":
        js = nc.jetstream()
        try:
            kv = await js.key_value(bucket)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, storage=StorageType.FILE,
                               description="rlbus controller answers by command id")
            )
        return cls(kv)

    @staticmethod
    def _key(command_id: str) -> str:
        return hashlib.blake2b(command_id.encode(), digest_size=16).hexdigest()  # any id, a valid key

    async def get(self, command_id: str) -> StoredReply | None:
        try:
            e = await self.kv.get(self._key(command_id))
        except KeyNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001
            log.warning("answer store unreachable (%s); running the command", e)
            return None
        return _stored.decode(e.value) if e.value else None

    async def put(self, command_id: str, stored: StoredReply) -> None:
        try:
            await self.kv.put(self._key(command_id), encode(stored))
        except Exception as e:  # noqa: BLE001
            log.warning("answer to command %s not kept in KV: %s", command_id, e)


_stored = msgspec.json.Decoder(StoredReply)
_desired = msgspec.json.Decoder(FleetState)
