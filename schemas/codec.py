"""Encoders and decoders, built once. JSON so `nats req` can talk to rlbus by hand."""

from __future__ import annotations

from typing import Union

import msgspec

from .control_commands import AnyControlCommand
from .events import AnyEvent
from .generate import GenerateReply, GenerateRequest
from .replies import AnyReply, Nack, VersionInfo
from .worker_commands import AnyWorkerCommand

_encoder = msgspec.json.Encoder()
encode = _encoder.encode

control_decoder = msgspec.json.Decoder(AnyControlCommand)
"""What the controller accepts on rl.control.<op>."""
worker_command_decoder = msgspec.json.Decoder(AnyWorkerCommand)
"""What a worker accepts on rl.worker.<id>.<op>."""
reply_decoder = msgspec.json.Decoder(AnyReply)
event_decoder = msgspec.json.Decoder(AnyEvent)
generate_request_decoder = msgspec.json.Decoder(GenerateRequest)
generate_reply_decoder = msgspec.json.Decoder(Union[GenerateReply, Nack])
version_decoder = msgspec.json.Decoder(VersionInfo)
"""The committed-version record, as the state KV holds it and rl.version carries it."""

DecodeError = msgspec.DecodeError
ValidationError = msgspec.ValidationError
