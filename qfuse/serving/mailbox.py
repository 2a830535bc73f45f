"""Events from the engine's thread to the server's event loop, one wake-up for many.

Each token of each stream becomes an event put on its request's asyncio queue. Handed
over one by one (`loop.call_soon_threadsafe` per event), every event writes a byte to the
loop's self-pipe: a system call that also releases the interpreter lock, which the engine
thread must then win back from the busy loop. At 256 streams the engine thread spent 209
of its 1411 samples in that write (py-spy over `python bench/engine_host.py 256 128 http`,
NOTES "Serving"). A `Mailbox` collects the events posted while the loop has not yet run
its delivery and wakes the loop once for all of them; each queue still gets its events
in the order they were posted.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

_BOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = \
    weakref.WeakKeyDictionary()
_BOXES_LOCK = threading.Lock()


class Mailbox:
    """``post(queue, item)`` from any thread: ``queue.put_nowait(item)`` on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, object]] = []
        self._lock = threading.Lock()

    def post(self, queue: asyncio.Queue, item) -> None:
        """Deliver ``item`` to ``queue`` on the loop; RuntimeError if the loop is closed
        (as call_soon_threadsafe raises), the item then not delivered."""
        with self._lock:
            self._items.append((queue, item))
            first = len(self._items) == 1  # else a delivery is already on its way
        if first:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # a closed loop: drop what waits, so the next post raises too
                with self._lock:
                    self._items.clear()
                raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


def for_loop(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The one mailbox of ``loop`` (made at its first use)."""
    with _BOXES_LOCK:
        box = _BOXES.get(loop)
        if box is None:
            box = _BOXES[loop] = Mailbox(loop)
        return box
