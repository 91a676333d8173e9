"""What every process the supervisor starts does first: log as the pod does, leave Ctrl-C to the
supervisor, and never outlive it."""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import signal
import sys
import threading
import time

LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
PARENT_CHECK_S = 1.0


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:  # the supervisor is gone (killed): nobody will stop us
            os._exit(1)


def exit_now(code: int) -> None:
    """End a child whose work is done and flushed: skip the interpreter's teardown of torch and
    the rest, which takes seconds and holds up the pod's stop.

    What multiprocessing made in this process is still released, as a multiprocessing child's own
    exit does first: a named semaphore left behind (tqdm's lock is one, made when transformers shows
    a progress bar while loading) would be reported as leaked by the supervisor's resource tracker
    when the pod stops."""
    multiprocessing.util._run_finalizers(0)  # the first step of that exit (private: no public form)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_child(log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    # progress bars (transformers' while loading) need no lock across processes: tqdm's default one is
    # a named semaphore, which a child killed by a signal would leave to the resource tracker
    from tqdm import tqdm  # here: the CLI imports this module for LOG_FORMAT, in images without tqdm

    tqdm.set_lock(threading.RLock())
    # a terminal's Ctrl-C reaches the whole process group: the supervisor alone decides what it means
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
