"""The rendezvous every backend shares: a TCPStore hosted by the trainer, prefixed per group."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import torch.distributed as dist

from rlbus.schemas import TransferInit
from rlbus.transfer.base import TransferError, timeout_error

HOST_ATTEMPTS = 3
"""Tries at hosting the store when its own first connection times out (a loaded host)."""


def host_store(init: TransferInit) -> tuple[dist.Store, dist.TCPStore, TransferInit]:
    """Listen on ``init.master_addr:init.master_port`` (0 = a free port) without waiting.

    Returns the group-prefixed store, the raw TCPStore (keep it alive: it is the
    server) and ``init`` with the chosen port filled in.
    """
    if init.world_size < 2:
        raise TransferError(f"world_size must count the trainer and at least one worker, got {init.world_size}")
    if not init.group_name:
        raise TransferError("group_name must be set: it keys the rendezvous store")
    for attempt in range(HOST_ATTEMPTS):
        try:
            raw = dist.TCPStore(
                init.master_addr,
                init.master_port,
                init.world_size,
                is_master=True,
                timeout=timedelta(seconds=init.timeout_s),
                wait_for_workers=False,
            )
            break
        except Exception as e:
            # the server connects to itself first; on a loaded host that can miss a short timeout
            if "timed out" in str(e) and attempt + 1 < HOST_ATTEMPTS:
                continue
            err = timeout_error(init, f"hosting the rendezvous on {init.master_addr}:{init.master_port}", e)
            raise err from e
    bound = msgspec.structs.replace(init, master_port=raw.port)
    return dist.PrefixStore(init.group_name + "/", raw), raw, bound


def connect_store(init: TransferInit) -> tuple[dist.Store, dist.TCPStore]:
    """Connect to the trainer's store; retries until ``init.timeout_s``."""
    if not init.master_port:
        raise TransferError("master_port is 0: join with the init the trainer returned from bind()")
    try:
        raw = dist.TCPStore(
            init.master_addr,
            init.master_port,
            init.world_size,
            is_master=False,
            timeout=timedelta(seconds=init.timeout_s),
        )
    except Exception as e:
        raise timeout_error(init, f"connecting to rendezvous {init.master_addr}:{init.master_port}", e) from e
    return dist.PrefixStore(init.group_name + "/", raw), raw
