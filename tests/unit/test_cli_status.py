"""`rlbus status` names quarantined workers and the push lease's holder; no server."""

from __future__ import annotations

from rlbus.schemas import Capabilities, PushLease, ServerInfo, WorkerInfo, WorkerState

from rlbus.runners.cli import _print_status


def test_status_names_a_quarantined_worker_and_the_push_lease_holder(capsys):
    info = ServerInfo(
        workers=[
            WorkerInfo(
                worker_id="w1",
                capabilities=Capabilities(),
                state=WorkerState(worker_id="w1", withheld=True),
                rank=0,
                behind=True,
                quarantined=True,
            )
        ],
        capabilities=Capabilities(),
        weight_version="v2",
        weight_seq=2,
        quarantined=["w1"],
        push_lease=PushLease(trainer_id="trainer-a", renewed_at=0.0, lease_s=60.0),
    )
    _print_status(info)
    out = capsys.readouterr().out
    assert "(quarantined)" in out and "quarantined (missed a decided commit" in out and "w1" in out
    assert "push lease held by trainer trainer-a" in out
