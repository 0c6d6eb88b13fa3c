"""Stop an engine process whose front process has died.

The front starts engines in their own session, so a `kill -9` of the front
would otherwise leave them running, holding the model's memory. When the
parent goes away the kernel re-parents the child, and `os.getppid()` changes.
"""

import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


def watch_parent(on_orphaned: Callable[[], None], interval_s: float = 1.0) -> threading.Thread:
    """Call `on_orphaned` once, from a daemon thread, when this process loses its parent."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(interval_s)
        log.warning("parent process %d is gone; stopping", parent)
        on_orphaned()

    thread = threading.Thread(target=watch, name="mlxserve-orphan-watch", daemon=True)
    thread.start()
    return thread
