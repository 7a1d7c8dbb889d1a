"""verify_weights: does every worker serve the same bits? Each worker hashes what it serves;
the controller compares the replicas with each other, or with the trainer's checksums."""

from __future__ import annotations

import hashlib
from collections import Counter

from rlbus.schemas import HashWeightsWorker, TensorChecksum, VerifyWeights, WeightCheck, WorkerWeights

from .fanout import Outcome
from .fleet import Fleet, stamped

LIVE_MODEL = "<live model>"
"""Named in `differs` when a worker's live model differs from the other replicas' of its engine."""
MAX_NAMED = 20
"""A worker's entry names this many differing tensors at most (the reply fits one message)."""


async def verify_weights(fleet: Fleet, cmd: VerifyWeights) -> WeightCheck:
    """Under the fleet's lock, so no commit lands while the workers hash."""
    async with fleet.lock:
        out = await fleet.send(stamped(HashWeightsWorker, target=cmd.target))
    out.raise_for_failures("verify_weights")
    return compare(out, cmd)


def digest(sums: dict[str, str]) -> str:
    """One hash of every (name, checksum) pair, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(sums):
        h.update(f"{name}\0{sums[name]}\n".encode())
    return h.hexdigest()


def compare(out: Outcome, cmd: VerifyWeights) -> WeightCheck:
    """Every answer against the reference: the trainer's checksums when it sent them, else the
    digest most workers share (a tie: the first worker's, in rank order). Engines that hash
    their live model apart (vLLM) are also compared with each other on it, the same way."""
    order = sorted(out.answers)
    held = {w: _sums(out.answers[w].tensor_checksums) for w in order}
    digests = {w: digest(s) for w, s in held.items()}
    if cmd.expected:
        reference, kind = _sums(cmd.expected), "trainer"
    else:
        counts = Counter(digests.values())
        top = max(counts.values(), default=0)
        first = next((w for w in order if counts[digests[w]] == top), None)
        reference, kind = (held[first] if first is not None else {}), "replicas"
    live = {w: out.answers[w].live_checksum for w in order if out.answers[w].live_checksum}
    live_counts = Counter(live.values())
    live_top = max(live_counts.values(), default=0)
    live_ref = next((live[w] for w in order if w in live and live_counts[live[w]] == live_top), "")
    workers, mismatched = [], []
    for w in order:
        names = sorted(held[w].keys() | reference.keys())
        differs = [n for n in names if held[w].get(n) != reference.get(n)]
        if w in live and live[w] != live_ref:  # its checkpoint copy may agree while what it computes with does not
            differs.insert(0, LIVE_MODEL)
        if differs:
            mismatched.append(w)
        state = out.acks[w]
        workers.append(
            WorkerWeights(
                worker_id=w,
                weight_version=state.weight_version,
                weight_seq=state.weight_seq,
                tensors=len(held[w]),
                digest=digests[w],
                differs=differs[:MAX_NAMED],
                live_digest=live.get(w, ""),
            )
        )
    return WeightCheck(
        ok=not mismatched,
        target=cmd.target,
        reference=kind,
        mismatched=mismatched,
        workers=workers,
        seconds=max(out.seconds.values(), default=0.0),
    )


def _sums(checksums: list[TensorChecksum]) -> dict[str, str]:
    return {c.name: c.checksum for c in checksums}
