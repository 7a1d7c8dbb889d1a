from __future__ import annotations

import typing

import msgspec
import pytest
import rlbus.schemas as s
from rlbus.schemas import FailedPrecondition, Unavailable, error_for, from_nack


def _control_commands() -> list[s.ControlCommand]:
    return [
        s.Pause(mode="keep", command_id="c1"),
        s.Resume(),
        s.IsPaused(),
        s.Sleep(level=2, tags=["weights"]),
        s.WakeUp(tags=["kv_cache"]),
        s.IsSleeping(),
        s.GetServerInfo(),
        s.InitWeightTransfer(backend="gloo", init_info=s.TransferInit(backend="gloo", master_port=1234, world_size=3)),
        s.StartWeightUpdate(target="draft"),
        s.UpdateWeights(
            session_id="abc",
            params=[s.ParamMeta(name="w", dtype="bfloat16", shape=[2, 3], bucket=0, offset=0, nbytes=12)],
            buckets=[s.BucketMeta(index=0, nbytes=64)],
        ),
        s.FinishWeightUpdate(weight_version="step-1"),
        s.AbortWeightUpdate(reason="x"),
        s.UpdateWeightVersion(new_version="v2"),
        s.GetWeightVersion(),
        s.VerifyWeights(target="draft", expected=[s.TensorChecksum(name="w", checksum="ab" * 16)]),
    ]


def _worker_commands() -> list[s.WorkerCommand]:
    stamp = {"epoch": 3, "command_id": "c1"}
    return [
        s.PauseWorker(mode="keep", **stamp),
        s.ResumeWorker(**stamp),
        s.SleepWorker(level=2, tags=["weights"], **stamp),
        s.WakeUpWorker(tags=["kv_cache"], **stamp),
        s.StatusWorker(**stamp),
        s.InitWeightTransferWorker(
            init_info=s.TransferInit(backend="gloo", master_port=1234, world_size=3), rank=1, **stamp
        ),
        s.StartWeightUpdateWorker(target="draft", session_id="abc", **stamp),
        s.UpdateWeightsWorker(
            session_id="abc",
            params=[s.ParamMeta(name="w", dtype="bfloat16", shape=[2, 3], bucket=0, offset=0, nbytes=12)],
            buckets=[s.BucketMeta(index=0, nbytes=64)],
            check_only=True,
            **stamp,
        ),
        s.PrepareWorker(session_id="abc", **stamp),
        s.CommitWorker(session_id="abc", weight_version="v", **stamp),
        s.AbortWeightUpdateWorker(session_id="abc", reason="x", **stamp),
        s.UpdateWeightVersionWorker(new_version="v2", **stamp),
        s.SyncWorker(committed_version="step-3", **stamp),
        s.HashWeightsWorker(target="draft", **stamp),
        s.OfferWeightsWorker(target="main", init_info=s.TransferInit(backend="gloo", world_size=2), **stamp),
        s.SendWeightsWorker(group_name="g", first=0, last=2, **stamp),
        s.LeaveWeightTransferWorker(group_name="g", **stamp),
    ]


@pytest.mark.parametrize("cmd", _control_commands(), ids=lambda c: type(c).__name__)
def test_every_control_command_round_trips_through_its_routes_decoder(cmd):
    assert msgspec.json.Decoder(type(cmd)).decode(s.encode(cmd)) == cmd  # what its route decodes with


@pytest.mark.parametrize("cmd", _worker_commands(), ids=lambda c: type(c).__name__)
def test_every_worker_command_round_trips_through_its_routes_decoder(cmd):
    assert msgspec.json.Decoder(type(cmd)).decode(s.encode(cmd)) == cmd


def test_every_command_tag_is_an_op_name():
    assert set(s.CONTROL_OPS) == {s.op_of(c) for c in _control_commands()}
    assert set(s.WORKER_OPS) == {s.op_of(c) for c in _worker_commands()}


def test_every_worker_command_is_named_after_its_wire_tag():
    """The tag is the contract; the class says it: `start_weight_update` -> StartWeightUpdateWorker."""
    for cls in typing.get_args(s.AnyWorkerCommand):
        tag = s.op_of(cls)
        assert cls.__name__ == "".join(w.capitalize() for w in tag.split("_")) + "Worker", (cls.__name__, tag)


def test_a_worker_command_needs_the_controllers_stamp():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.Decoder(s.PauseWorker).decode(b'{"kind":"pause","mode":"abort"}')


def test_a_control_command_carries_no_worker_only_field():
    assert "rank" not in s.InitWeightTransfer.__struct_fields__
    assert "epoch" not in s.ControlCommand.__struct_fields__
    assert "check_only" not in s.UpdateWeights.__struct_fields__


def test_a_reply_without_version_spans_still_decodes_and_a_reply_with_them_round_trips():
    """weight_versions is a new field with a default: an older worker's reply decodes."""
    old = s.generate_reply_decoder.decode(
        b'{"kind":"generate_reply","worker_id":"w0","tokens":[1],"finish_reason":"length","weight_version":"v"}'
    )
    assert old.weight_versions == []
    spans = [
        s.WeightVersionSpan(version="v1", seq=1, start=0, end=3),
        s.WeightVersionSpan(version="v2", seq=2, start=3, end=5),
    ]
    reply = s.GenerateReply(
        worker_id="w0",
        tokens=[1, 2, 3, 4, 5],
        finish_reason="length",
        weight_version="v1",
        weight_seq=1,
        weight_versions=spans,
    )
    assert s.generate_reply_decoder.decode(s.encode(reply)) == reply
    assert b'"weight_versions":[{"version":"v1","seq":1,"start":0,"end":3}' in s.encode(reply)


def test_replies_and_events_round_trip():
    state = s.WorkerState(worker_id="w0", paused=True, pause_mode="keep", sleeping_tags=["kv_cache"])
    caps = s.Capabilities(sleep_mode_enabled=True, weight_transfer_backend="shm")
    for reply in [
        s.Nack(
            code="UNAVAILABLE",
            message="gone",
            failures=[s.WorkerFailure(worker_id="w1", code="UNAVAILABLE", message="x")],
        ),
        s.WorkerAck(state=state),
        s.FleetAck(workers=[state], session_id="s", weight_version="v"),
        s.ServerInfo(workers=[s.WorkerInfo(worker_id="w0", capabilities=caps, state=state, rank=0)], capabilities=caps),
        s.VersionInfo(version="step-3", epoch=2, workers=2, time=1.5),
    ]:
        assert s.reply_decoder.decode(s.encode(reply)) == reply
    for ev in [
        s.WorkerReady(worker_id="w0", capabilities=caps, state=state),
        s.Heartbeat(worker_id="w0", state=state),
        s.WorkerGone(worker_id="w0"),
        s.ControllerHello(epoch=4),
        s.FleetEvent(event="paused", workers=["w0"]),
    ]:
        assert s.event_decoder.decode(s.encode(ev)) == ev


def test_an_unknown_kind_or_bad_field_does_not_decode():
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.Decoder(s.Pause).decode(b'{"kind":"format_disk"}')
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.Decoder(s.Pause).decode(b'{"kind":"pause","mode":"sideways"}')
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.Decoder(s.Sleep).decode(b'{"kind":"sleep","level":3}')
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.Decoder(s.Pause).decode(b"\x00not json")


def test_subjects_are_built_under_the_prefix_and_refuse_wildcards():
    subj = s.Subjects(prefix="rl")
    assert subj.control("pause") == "rl.control.pause"
    assert subj.worker("w0", "sleep") == "rl.worker.w0.sleep"
    assert subj.kv_bucket == "rl_state"
    with pytest.raises(ValueError):
        s.Subjects(prefix="rl.*")
    with pytest.raises(ValueError):
        s.check_token("a.b", "worker id")


def test_schemas_import_neither_torch_nor_nats():
    import subprocess
    import sys

    code = "import sys, rlbus.schemas; print(any(m in sys.modules for m in ('torch', 'nats')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_each_code_maps_to_its_own_exception():
    assert isinstance(error_for("FAILED_PRECONDITION", "m"), FailedPrecondition)
    e = from_nack(
        s.Nack(
            code="UNAVAILABLE", message="m", failures=[s.WorkerFailure(worker_id="w3", code="UNAVAILABLE", message="x")]
        )
    )
    assert isinstance(e, Unavailable) and e.workers == ["w3"] and e.code == "UNAVAILABLE"


def test_a_worker_state_leaves_its_defaults_out_of_the_wire_and_decodes_whole():
    state = s.WorkerState(worker_id="w7", paused=True, pause_mode="abort", epoch=3, weight_version="v1", weight_seq=2)
    assert s.encode(state) == (
        b'{"worker_id":"w7","paused":true,"pause_mode":"abort","epoch":3,"weight_version":"v1","weight_seq":2}'
    )
    wire = s.encode(s.FleetAck(workers=[state], epoch=3))
    back = s.reply_decoder.decode(wire)
    assert isinstance(back, s.FleetAck) and back.workers == [state]
    assert back.workers[0].weights_loaded is True and back.workers[0].sleeping_tags == []
