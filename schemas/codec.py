"""Encoders and decoders, built once. JSON so `nats req` can talk to rlbus by hand."""

from __future__ import annotations

import msgspec

from .commands import AnyCommand
from .events import AnyEvent
from .generate import GenerateReply, GenerateRequest
from .replies import AnyReply, Nack
from typing import Union

_encoder = msgspec.json.Encoder()
encode = _encoder.encode

command_decoder = msgspec.json.Decoder(AnyCommand)
reply_decoder = msgspec.json.Decoder(AnyReply)
event_decoder = msgspec.json.Decoder(AnyEvent)
generate_request_decoder = msgspec.json.Decoder(GenerateRequest)
generate_reply_decoder = msgspec.json.Decoder(Union[GenerateReply, Nack])

DecodeError = msgspec.DecodeError
ValidationError = msgspec.ValidationError
