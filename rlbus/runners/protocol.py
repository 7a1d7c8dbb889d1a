"""The protocol reference (`docs/protocol.md`) and JSON Schemas, generated from the schemas.

Nothing here is hand-kept about a message: fields, types, defaults and meanings come from the
Structs (their field docstrings are read from the source), subjects from `Subjects`, codes from
`schemas/codes.py`. `tests/unit/test_protocol_doc.py` regenerates the file and fails on a diff.
"""

from __future__ import annotations

import ast
import inspect
import json
import typing
from pathlib import Path

import msgspec

import rlbus.schemas as s
from rlbus.bus.replies import REASK_MAX, REASK_S
from rlbus.schemas.subjects import (
    FIRST_SEND_HEADER,
    HANDED_BACK_HEADER,
    RESEND_TO_HEADER,
    SENDS_AGAIN_HEADER,
    KvKey,
    ServiceName,
)

PREFIX = "rl"


def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string right under a field) of a class and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("rlbus.schemas"):
            try:
                tree = ast.parse(inspect.getsource(klass))
            except (OSError, TypeError):
                continue
            body = tree.body[0].body  # type: ignore[attr-defined]
            for a, b in zip(body, body[1:]):
                if (
                    isinstance(a, ast.AnnAssign)
                    and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)
                ):
                    docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _type(t: msgspec.inspect.Type) -> str:
    m = msgspec.inspect
    if isinstance(t, m.StrType):
        return "string"
    if isinstance(t, m.BoolType):
        return "bool"
    if isinstance(t, m.IntType):
        return "int"
    if isinstance(t, m.FloatType):
        return "float"
    if isinstance(t, m.NoneType):
        return "null"
    if isinstance(t, m.LiteralType):
        return " \\| ".join(json.dumps(v) for v in t.values)
    if isinstance(t, m.ListType):
        return f"list of {_type(t.item_type)}"
    if isinstance(t, m.UnionType):
        return " or ".join(_type(x) for x in t.types)
    if isinstance(t, m.StructType):
        return f"`{t.cls.__name__}`"
    return type(t).__name__.removesuffix("Type").lower()


def _fields(cls: type[msgspec.Struct]) -> list[str]:
    docs = _field_docs(cls)
    rows = ["| field | type | required | default | meaning |", "|---|---|---|---|---|"]
    for f in msgspec.inspect.type_info(cls).fields:  # type: ignore[union-attr, attr-defined]
        default = (
            ""
            if f.required
            else ("`" + json.dumps(msgspec.to_builtins(f.default)) + "`" if f.default is not msgspec.NODEFAULT else "")
        )
        rows.append(
            f"| `{f.name}` | {_type(f.type)} | {'yes' if f.required else 'no'} | {default} | {docs.get(f.name, '')} |"
        )
    return rows


def _sample(t: msgspec.inspect.Type) -> object:
    m = msgspec.inspect
    if isinstance(t, m.LiteralType):
        return t.values[0]
    if isinstance(t, m.StrType):
        return "w0"
    if isinstance(t, m.IntType):
        return 1
    if isinstance(t, m.FloatType):
        return 1.0
    if isinstance(t, m.BoolType):
        return False
    if isinstance(t, m.ListType):
        return []
    if isinstance(t, m.UnionType):
        return _sample(next(x for x in t.types if not isinstance(x, m.NoneType)))
    if isinstance(t, m.StructType):
        return example(t.cls)
    return None


def example(cls: type[msgspec.Struct]) -> msgspec.Struct:
    """An instance with every required field filled by a plain sample value."""
    info = msgspec.inspect.type_info(cls)
    required = {f.name: _sample(f.type) for f in info.fields if f.required}  # type: ignore[union-attr, attr-defined]
    return msgspec.convert(required, cls, from_attributes=False) if not issubclass(cls, s.Message) else cls(**required)  # type: ignore[call-arg]


def _json(obj: object) -> str:
    return json.dumps(msgspec.to_builtins(obj), indent=None)


def _message(cls: type[msgspec.Struct], heading: str = "####") -> list[str]:
    tag = cls.__struct_config__.tag
    title = f"{heading} `{cls.__name__}`" + (f" (kind `{tag}`)" if isinstance(tag, str) else "")
    own = cls.__dict__.get("__doc__") or ""
    doc = "" if own.startswith(cls.__name__ + "(") else inspect.cleandoc(own)  # msgspec writes a signature when none
    return [title, "", *([" ".join(doc.split()), ""] if doc else []), *_fields(cls), ""]


def _subjects() -> list[str]:
    subj = s.Subjects(prefix=PREFIX)
    rows = ["| subject | what |", "|---|---|"]
    entries = [
        ("control", subj.control("<op>")),
        ("worker", subj.worker("<id>", "<op>")),
        ("worker_event", subj.worker_event("<id>", "<ready|heartbeat|gone>")),  # type: ignore[arg-type]
        ("controller_hello", subj.controller_hello),
        ("version", subj.version),
        ("event", subj.event("<kind>")),
        ("generate", subj.generate),
        ("generate_at", subj.generate_at("<id>")),
        ("inbox", subj.inbox("<identity>") + ".>"),
        ("kv_bucket", subj.kv_bucket),
        ("replies_bucket", subj.replies_bucket),
    ]
    for name, value in entries:
        doc = " ".join((inspect.getdoc(getattr(s.Subjects, name)) or "").split())
        what = "KV bucket " if name.endswith("bucket") else ""
        rows.append(f"| {what}`{value}` | {doc} |".replace("|heartbeat|", "\\|heartbeat\\|"))
    return rows


def _kv_keys() -> list[str]:
    docs = {}
    tree = ast.parse(inspect.getsource(KvKey))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.Assign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.targets[0].id] = " ".join(str(b.value.value).split())  # type: ignore[attr-defined]
    rows = ["| key | holds |", "|---|---|"]
    for attr, doc in docs.items():
        rows.append(f"| `{getattr(KvKey, attr)}` | {doc} |")
    return rows


def render() -> str:
    """docs/protocol.md."""
    fleet = s.FleetAck(workers=[s.WorkerState(worker_id="w0")], weight_version=s.DEFAULT_VERSION, epoch=1)
    replies: dict[type, object] = {
        s.FleetAck: fleet,
        s.ServerInfo: s.ServerInfo(workers=[], capabilities=s.Capabilities(), epoch=1),
        s.VersionInfo: s.VersionInfo(version="step-1", seq=1, epoch=1, workers=1, time=1767225600.0),
    }
    out = [
        "# The rlbus wire protocol",
        "",
        "<!-- generated by `rlbus protocol` from schemas/ (rlbus/runners/protocol.py); do not edit by hand -->",
        "",
        "Every message is a JSON object. Its `kind` names it; on a request subject (`rl.control.<op>`,",
        "`rl.worker.<id>.<op>`, `rl.generate`) `kind` may be left out, since the subject names it, and",
        "must match when present. An empty request body is the command with every default. Unknown",
        "fields are ignored (new fields always come with defaults); a worker's state (`WorkerState`,",
        "in every `worker_ack`, `fleet_ack` and `server_info`) leaves out each field at its default,",
        "so a reader fills in the defaults listed below. A request that is not a JSON",
        "object, names another kind, or an op that does not exist gets a NATS service error: an empty",
        f"body with headers `Nats-Service-Error-Code: {s.UNDECODABLE_STATUS}` and `Nats-Service-Error: <why>`",
        "(SDK: `BadRequest`, code `BAD_REQUEST`). A request of the right kind with a wrong value or a",
        "missing required field is refused with a `nack` (code `INVALID_ARGUMENT`, naming the field and",
        "the values it allows). Payloads are bounded by the NATS server's `max_payload` (1 MiB by",
        "default); the SDK splits weight metadata to fit it.",
        "",
        "`command_id` must be unique per command; a retry resends the same id and bytes and gets the",
        "first answer (kept across a controller restart for state-changing commands). `timeout_s`",
        "tells the controller how long the sender waits: it gives up no later. A send may carry the",
        f"header `{FIRST_SEND_HEADER}: 1` when it is the first send of an id made for it (never on a",
        "resend): a `pause` or `resume` so marked is claimed beside its fan-out instead of before it.",
        "",
        f"Service discovery: `$SRV.PING|INFO|STATS.<name>` with names `{ServiceName.CONTROLLER}`, "
        f"`{ServiceName.WORKER}`, `{ServiceName.GENERATE}` (only workers taking generation traffic).",
        "",
        f"## Subjects (prefix `{PREFIX}`)",
        "",
        *_subjects(),
        "",
        "## Control commands: trainer → controller on `rl.control.<op>`",
        "",
    ]
    for cls in typing.get_args(s.AnyControlCommand):
        reply = cls.reply
        out += _message(cls, "###")
        req = example(cls)
        out += [
            f"Answers `{reply.__struct_config__.tag}` (`{reply.__name__}`) or `nack`. Example:",
            "",
            "```",
            f"→ {s.subjects.Subjects(PREFIX).control(s.op_of(cls))}  {_json(req)}",
            f"← {_json(replies.get(reply, example(reply)))}",
            "```",
            "",
        ]
    out += ["## Replies and records", ""]
    for cls in (
        s.FleetAck,
        s.Nack,
        s.WorkerFailure,
        s.ServerInfo,
        s.VersionInfo,
        s.WorkerState,
        s.WorkerInfo,
        s.Capabilities,
        s.FleetState,
        s.TransferInit,
        s.ParamMeta,
        s.BucketMeta,
    ):
        out += _message(cls)
    out += [
        "## Generation: anyone → one worker on `rl.generate` (queue group)",
        "",
        f"A request with a `request_id` and the header `{SENDS_AGAIN_HEADER}: 1` (the SDK's) is answered first",
        f"by a message with no body and the header `{RESEND_TO_HEADER}: {s.Subjects(PREFIX).generate_at('<id>')}` from",
        "the worker that took it: not the answer, but where a send again goes (a caller sends again",
        "after its link came back, since a reply sent while it was down is lost, and, while no answer",
        f"came, after {REASK_S:g} s, {2 * REASK_S:g}, {4 * REASK_S:g}, then every {REASK_MAX * REASK_S:g} s, for a reply lost on the worker's side). Every send",
        "of a request carries the reply subject of its first send. There the worker answers from its",
        "run of that id: one still under way with the same word (its reply goes to that reply subject),",
        "one answered in the last two minutes with its reply; one it does not know it runs. So a request",
        "is not run a second time on another worker. Without the header the answer comes alone.",
        "",
        "A worker hands back a request it will not start: as it stops, one it holds (it arrived while the",
        "fleet was paused, or waits for a free slot) or one sent again to it that it does not know; or one",
        "that reached it as it left the queue group (withheld, or cut off from its controller). To a request",
        f"with the header it sends a message with no body and the header `{HANDED_BACK_HEADER}: 1`, on which",
        "the caller sends it through the queue group again (at once, then after a growing pause from 50 ms),",
        "where another worker takes it; without the header it answers",
        "`UNAVAILABLE` saying the request was not started. Nothing of it ran on that worker.",
        "",
    ]
    for cls in (s.GenerateRequest, s.GenerateReply, s.WeightVersionSpan):
        out += _message(cls)
    out += [
        "## Error codes (`nack.code`, `failures[].code`)",
        "",
        "| code | meaning |",
        "|---|---|",
        *(f"| `{c}` | {s.codes.ERROR_MEANINGS[c]} |" for c in s.ERROR_CODES),
        "",
        f"## The state bucket (`{s.Subjects(PREFIX).kv_bucket}`)",
        "",
        *_kv_keys(),
        "",
        "`version` holds a `VersionInfo` from the first leader's start on (`default`, seq 0, until a commit).",
        "",
        "## Events: controller → anyone on `rl.events.<kind>` and worker → controller",
        "",
    ]
    for cls in typing.get_args(s.AnyEvent):
        out += _message(cls)
    out += [
        "## Worker commands: controller → one worker on `rl.worker.<id>.<op>`",
        "",
        "Each answers `worker_ack` (`WorkerAck`: the worker's state afterwards) or `nack`.",
        "",
    ]
    for cls in typing.get_args(s.AnyWorkerCommand):
        out += _message(cls, "####")
    return "\n".join(out).rstrip() + "\n"


def json_schemas() -> dict[str, dict[str, object]]:
    """A JSON Schema per message: `control.<op>` and `worker.<op>` for the commands (the two
    directions share op names), the kind for every other message."""
    out: dict[str, dict[str, object]] = {}
    for direction, union in (("control", s.AnyControlCommand), ("worker", s.AnyWorkerCommand)):
        for t in typing.get_args(union):
            out[f"{direction}.{s.op_of(t)}"] = msgspec.json.schema(t)
    for t in (*typing.get_args(s.AnyReply), *typing.get_args(s.AnyEvent), s.GenerateRequest, s.GenerateReply):
        out[s.op_of(t)] = msgspec.json.schema(t)
    return out


def write_schemas(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in json_schemas().items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
