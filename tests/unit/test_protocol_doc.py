"""docs/protocol.md is generated from the schemas and kept in step with them."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import msgspec
import rlbus.schemas as s

from rlbus.runners.protocol import example, json_schemas, render

ROOT = Path(__file__).resolve().parents[2]


def test_the_protocol_reference_is_what_the_schemas_generate():
    assert (ROOT / "docs" / "protocol.md").read_text() == render(), "run `rlbus protocol --out docs/protocol.md`"


def test_the_reference_documents_every_control_op_with_its_reply_and_every_error_code():
    text = render()
    for cls in typing.get_args(s.AnyControlCommand):
        assert f"(kind `{s.op_of(cls)}`)" in text and f"Answers `{cls.reply.__struct_config__.tag}`" in text
    for code in s.ERROR_CODES:
        assert f"| `{code}` |" in text


def test_every_worked_example_decodes_as_its_message():
    for cls in (*typing.get_args(s.AnyControlCommand), *typing.get_args(s.AnyWorkerCommand)):
        sample = example(cls)
        assert msgspec.json.Decoder(cls).decode(s.encode(sample)) == sample


def test_a_json_schema_per_message_validates_its_example_shape():
    schemas = json_schemas()
    assert {"control.pause", "worker.pause", "fleet_ack", "nack", "version", "generate", "worker_ack"} <= set(schemas)
    others = len(typing.get_args(s.AnyReply)) + len(typing.get_args(s.AnyEvent)) + 2  # + generate request and reply
    assert len(schemas) == len(typing.get_args(s.AnyControlCommand)) + len(typing.get_args(s.AnyWorkerCommand)) + others
    assert "weight_check" in schemas
    pause = schemas["control.pause"]["$defs"]["Pause"]  # type: ignore[index]
    assert pause["properties"]["mode"]["enum"] == ["abort", "keep", "wait"]  # type: ignore[index]
    json.dumps(schemas)  # every schema is plain JSON
    assert msgspec.json.decode(s.encode(example(s.Pause)))["kind"] == "pause"
