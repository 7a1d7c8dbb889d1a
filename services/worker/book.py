"""The worker's books: what weights it holds (version and commit sequence, of the main model
and the draft), whether they are dirty, whether it is withheld from generation, and which
controller it answers to. One owner (the worker service); changed only through the methods
below, each synchronous, so two fields that must agree (a version and its seq) change
together and no reader ever sees one without the other.

Engines read it (to label the tokens they produce) and never write it: a commit reaches it
through the callback an engine calls once new weights are in place (`Engine.load_weights`),
so the label moves with the weights, between two forward steps.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
from rlbus.schemas import DEFAULT_VERSION, UpdateTarget


class WeightLabel(msgspec.Struct, frozen=True):
    """Names one set of weights: a version string and its commit sequence (VersionInfo.seq)."""

    version: str = DEFAULT_VERSION
    seq: int = 0


TORN_SEQ = -1
"""The seq of weights an aborted in_place update half-wrote: no commit's bits, so no delta
may take them as its base."""


class Labels(Protocol):
    """What an engine may read of the books: the labels of the weights it runs."""

    @property
    def main(self) -> WeightLabel: ...

    @property
    def draft(self) -> WeightLabel: ...

    @property
    def dirty(self) -> bool: ...


class Book:
    """One per worker (and one per engine standing alone, until a worker attaches its own).

    Room to grow: a worker that missed a decided commit is quarantined (withheld until
    `holds(decided)`); that is one more field read by `withheld` and cleared by `commit`."""

    __slots__ = ("_main", "_draft", "_dirty", "_withheld", "_epoch", "_controller_id")

    def __init__(self) -> None:
        self._main = WeightLabel()
        self._draft = WeightLabel()
        self._dirty = False
        self._withheld = True
        self._epoch = 0
        self._controller_id = ""

    # ---- what it holds -------------------------------------------------------------------

    @property
    def main(self) -> WeightLabel:
        return self._main

    @property
    def draft(self) -> WeightLabel:
        return self._draft

    @property
    def dirty(self) -> bool:
        """in_place: an aborted update half-wrote the main weights; nothing is served until a commit."""
        return self._dirty

    def holds(self, label: WeightLabel, target: UpdateTarget = "main") -> bool:
        """It holds exactly these weights: this version under this seq, clean."""
        if target == "draft":
            return self._draft == label
        return self._main == label and not self._dirty

    def commit(self, target: UpdateTarget, version: str | None, seq: int) -> None:
        """A commit took effect: the weights now in place are `seq` (version None keeps the string)."""
        if target == "main":
            self._main = WeightLabel(self._main.version if version is None else version, seq)
            self._dirty = False
        else:
            self._draft = WeightLabel(self._draft.version if version is None else version, seq)

    def relabel(self, version: str, seq: int) -> None:
        """update_weight_version: the same main weights under a new version and seq."""
        self._main = WeightLabel(version, seq)

    def tear(self, target: UpdateTarget) -> None:
        """An aborted in_place update wrote some bytes: the main weights are dirty; the draft
        holds no commit's bits any more."""
        if target == "main":
            self._dirty = True
        else:
            self._draft = WeightLabel(self._draft.version, TORN_SEQ)

    # ---- how it stands -------------------------------------------------------------------

    @property
    def withheld(self) -> bool:
        """Takes no rl.generate traffic: until a controller has synced it (brought it to the
        fleet's desired state), while it is behind the committed version, and after it finds
        it was silent longer than the controller's liveness timeout (it may have been dropped)."""
        return self._withheld

    def withhold(self, on: bool) -> bool:
        """Withhold it from generation (or admit it); True if that changed anything."""
        changed = on != self._withheld
        self._withheld = on
        return changed

    @property
    def epoch(self) -> int:
        """Highest controller epoch seen; commands from older epochs are refused (fencing)."""
        return self._epoch

    @property
    def controller_id(self) -> str:
        """The controller that last synced this worker (or announced a newer epoch)."""
        return self._controller_id

    def obey(self, epoch: int) -> None:
        """A command of `epoch` ran: the fence moves up to it (never down)."""
        self._epoch = max(self._epoch, epoch)

    def follow(self, controller_id: str, epoch: int | None = None) -> None:
        """Answer to this controller (from `epoch` on, when given: a newer controller's hello)."""
        self._controller_id = controller_id
        if epoch is not None:
            self._epoch = max(self._epoch, epoch)
