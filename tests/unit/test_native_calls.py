"""The threads transfer calls run in (rlbus.transfer.base.NativeCalls): counted while a call
runs, kept between calls so a caller (an event loop) never waits for a thread to start."""

from __future__ import annotations

import threading

from rlbus.transfer import base
from rlbus.transfer.base import NativeCalls
from tests.waiting import eventually


def _run(calls: NativeCalls, name: str) -> tuple[int, str]:
    """One call through `calls`, waited for: the thread it ran on, and its name meanwhile."""
    seen: list[tuple[int, str]] = []
    done = threading.Event()

    def body() -> None:
        seen.append((threading.get_ident(), threading.current_thread().name))
        done.set()

    calls.thread(body, name)
    assert done.wait(10)
    assert calls.settle(10)
    return seen[0]


def _parked(ident: int) -> bool:
    return any(t.ident == ident and t.name == base.IDLE_NAME for t in threading.enumerate())


async def test_a_call_after_another_runs_on_the_kept_thread_under_its_own_name():
    calls = NativeCalls()
    first, name = _run(calls, "rlbus-one")
    assert name == "rlbus-one"
    await eventually(lambda: _parked(first), timeout=5, what="the thread parked")
    second, name = _run(calls, "rlbus-two")
    assert (second, name) == (first, "rlbus-two")


async def test_an_idle_kept_thread_drops_the_name_of_its_last_call_and_ends_after_its_idle_time(monkeypatch):
    monkeypatch.setattr(base, "KEPT_IDLE_S", 0.2)
    calls = NativeCalls()
    ident, _ = _run(calls, "rlbus-close-group")

    def named(prefix: str) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.ident == ident and t.name.startswith(prefix)]

    await eventually(lambda: not named("rlbus-close"), timeout=5, what="the last call's name dropped")
    await eventually(lambda: not any(t.ident == ident for t in threading.enumerate()), timeout=5, what="thread ended")


def test_no_more_than_kept_threads_stay_idle(monkeypatch):
    monkeypatch.setattr(base, "KEPT_THREADS", 2)
    calls = NativeCalls()
    gate, started = threading.Event(), threading.Semaphore(0)

    def held() -> None:
        started.release()
        gate.wait(10)

    for _ in range(5):  # five at once: five threads
        calls.thread(held, "rlbus-held")
    for _ in range(5):
        assert started.acquire(timeout=10)
    gate.set()
    assert calls.settle(10)

    def idle() -> int:
        with calls._cv:
            return len(calls._idle)

    assert idle() <= 2


def test_a_call_that_raises_is_counted_out_and_the_next_call_still_runs():
    calls = NativeCalls()

    def fails() -> None:
        raise RuntimeError("boom")

    hook, threading.excepthook = threading.excepthook, lambda args: None  # the thread's error is expected
    try:
        calls.thread(fails, "rlbus-fails")
        assert calls.settle(10)
    finally:
        threading.excepthook = hook
    _, name = _run(calls, "rlbus-after")
    assert name == "rlbus-after"


def test_many_calls_at_once_all_run_and_are_counted():
    n = 20
    calls = NativeCalls()
    ran = []
    lock = threading.Lock()

    def body() -> None:
        with lock:
            ran.append(1)

    for _ in range(n):
        calls.thread(body, "rlbus-many")
    assert calls.settle(10)
    assert len(ran) == n


def test_a_forked_child_runs_its_calls_on_threads_of_its_own():
    """A child forked while a thread is kept (vLLM may fork its engine's workers from a
    worker process) has none of the parent's threads: its calls must not be handed to them."""
    import os

    calls = NativeCalls()
    _run(calls, "rlbus-parent")
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its call ran
        ran, ok = threading.Event(), False
        try:
            calls.thread(ran.set, "rlbus-child")
            ok = ran.wait(10) and calls.settle(10)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
