"""A process that ends while a gloo receive wakes in its exit, the way a worker stopped
mid-push does: ``python -m tests.exiting_receiver {run_then_exit|return} CODE``.

Its trainer (a thread) and its worker form a real gloo group (buckets as sends, gloo's
default); the worker's receive waits in a daemon thread for a bucket that never comes. An
exit handler closes the worker's group and then the trainer's, so the receive wakes with an
error while the process exits; from then on
only a blocking call lets it take the GIL, and the first one a returning process makes is
in its finalization (``_Lingering``) unless rlbus waits for the receive first. Either way it
ends (``run_then_exit``, as a worker process does, or by returning, as a trainer's script
does) the process must end with CODE. Without rlbus.transfer.torchdist's exit handler a
returning process aborted in 6 of 6 runs: Python 3.11 finalized while the receive came back.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

import torch
from rlbus.schemas import TransferInit

from rlbus.runners.serve import run_then_exit
from rlbus.transfer.torchdist import TorchDistTrainer, TorchDistWorker


class _Lingering:
    """Held by this module: finalizing Python deletes it, and it blocks a while there, which
    lets any thread waiting for the GIL take it while the interpreter finalizes."""

    def __del__(self) -> None:
        time.sleep(0.2)


_lingering = _Lingering()


def main(code: int) -> None:
    tx, rx = TorchDistTrainer("gloo"), TorchDistWorker("gloo")
    init = tx.bind(TransferInit(backend="gloo", world_size=2, group_name="exiting-receiver", timeout_s=30.0))
    joining = threading.Thread(target=rx.join, args=(init, 1), daemon=True)
    joining.start()
    tx.open(init)
    joining.join()
    receiving = rx.recv(torch.empty(1 << 20, dtype=torch.uint8))
    waiting = threading.Event()

    def wait() -> None:
        waiting.set()
        try:
            receiving.wait()
        except Exception:
            pass

    threading.Thread(target=wait, name="receive", daemon=True).start()
    waiting.wait()

    def leave() -> None:
        rx.close()  # the worker stops: its group is closed
        tx.close()  # the trainer leaves: the receive wakes with an error
        # and only a blocking call lets the receive's thread take the GIL back from here on
        sys.setswitchinterval(10.0)

    atexit.register(leave)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    ending, status = sys.argv[1], int(sys.argv[2])
    if ending == "run_then_exit":
        run_then_exit(lambda: main(status))
    main(status)
