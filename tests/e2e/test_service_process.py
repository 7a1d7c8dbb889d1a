"""A service process (`rlbus controller`, `rlbus worker`, each run by runners/serve.py) takes
the heap it started with out of the cyclic collector's walks once it has started: a full
collection then walks only what was made since, not every import (with vLLM imported a full
walk stopped the event loop 140-300 ms). Real process, its own log, SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

FROZEN = re.compile(r"rlbus-controller: started; (\d+) objects alive at startup frozen")


def _first_match(proc: subprocess.Popen) -> re.Match[str] | None:
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := FROZEN.search(line):
            return m
    return None  # the process ended without saying it


def test_a_controller_process_freezes_its_startup_heap_once_it_has_started(nats_server):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlbus",
            "controller",
            "--nats-url",
            nats_server.url,
            "--prefix",
            "f" + uuid.uuid4().hex[:8],
        ],
        env=dict(os.environ, PYTHONUNBUFFERED="1", RLBUS_LOG_LEVEL="INFO"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    with ThreadPoolExecutor(1) as reader:
        said = reader.submit(_first_match, proc)
        try:
            m = said.result(timeout=30)
            assert m is not None, f"the controller exited ({proc.poll()}) without freezing its startup heap"
            assert int(m.group(1)) > 10_000, "the frozen heap misses the imports"
        finally:
            proc.send_signal(signal.SIGTERM)  # its stderr closes, and the reader returns
            assert proc.wait(timeout=30) == 0
