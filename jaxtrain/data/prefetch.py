"""prefetch_to_device: host batches -> sharded global jax.Arrays, in a background thread.

The classic fix for a device that idles while the host prepares the next
batch (PyTorch: ``pin_memory`` + CUDA streams): a thread copies the next
``size`` batches onto the devices while the current step runs. Where a batch
goes, and the checks on the way, are the plan's (``place``: a trainer's
``batches.shard``): the one path from the host to the devices.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator


_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class prefetch_to_device(Iterator):  # noqa: N801 - used like a function
    """Iterate over ``iterator``'s batches as device arrays, ``size`` batches ahead.

    An exception in the loader (or in the copy) is re-raised by ``next`` as
    soon as the consumer reaches it. ``close()`` (also on ``with`` exit, and
    when the object is garbage collected) stops and joins the thread.
    """

    def __init__(self, iterator: Iterable[dict], place: Callable[[dict], dict], size: int = 2):
        if size < 1:
            raise ValueError(f"prefetch size must be >= 1, got {size}")
        self._source = iter(iterator)
        self._place = place  # this process's rows -> global arrays, checked: the plan's (``trainer.batch_plan.shard``)
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="jaxtrain-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch in self._source:
                if not self._put(self._place(batch)):
                    return
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(_Failure(e))

    def __next__(self) -> dict:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the thread and wait for it; safe to call more than once."""
        self._done = True
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not self._done:
            self._stop.set()
