"""A process that ends while a gloo receive wakes in its exit, the way a worker stopped
mid-push does: ``python -m tests.exiting_receiver {sends|broadcasts} {run_then_exit|return} CODE``.

Its trainer (a thread) and its worker form a real gloo group; the worker's receive waits in a
daemon thread for a bucket that never comes. An exit handler closes the worker's group, so
the receive wakes with an error while the process exits. With ``run_then_exit`` the process
must end with CODE; with ``return`` Python finalizes, which aborts the process on Python
3.11-3.13 (kept to show what the test guards against).
"""

from __future__ import annotations

import atexit
import sys
import threading

import torch
from rlbus.schemas import TransferInit

from rlbus.runners.serve import run_then_exit
from rlbus.transfer.torchdist import TorchDistTrainer, TorchDistWorker


def main(broadcasts: bool, code: int) -> None:
    tx, rx = TorchDistTrainer("gloo", broadcasts=broadcasts), TorchDistWorker("gloo", broadcasts=broadcasts)
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
    atexit.register(tx.close)  # the trainer leaves as the process exits: the receive wakes with an error
    atexit.register(rx.close)  # (atexit runs these last first) the worker stops, its group is closed
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    mode, ending, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if ending == "run_then_exit":
        run_then_exit(lambda: main(mode == "broadcasts", status))
    main(mode == "broadcasts", status)
