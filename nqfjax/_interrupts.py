"""Holding SIGINT (Ctrl-C) back to the safe points of a block
(`defer_interrupts`): a sweep stops between chunks, never mid-trace."""

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator


class _Deferred:
    """A SIGINT handler that records the interrupt instead of raising it; a second
    SIGINT raises `KeyboardInterrupt` at once."""

    def __init__(self):
        self.pending = False

    def __call__(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
        # os.write, not print: the main thread may be inside a write to stderr
        # (a progress bar), and a buffered stream refuses a reentrant write
        message = (
            "\nnqfjax: interrupted: stopping once the chunk in progress is saved "
            "(press Ctrl-C again to stop at once)\n"
        )
        try:
            os.write(sys.stderr.fileno(), message.encode())
        except (AttributeError, OSError, ValueError):  # no file descriptor
            pass


@contextlib.contextmanager
def defer_interrupts() -> Iterator[Callable[[], bool]]:
    """Hold SIGINT (Ctrl-C) back to the safe points of a block.

    Inside the block a SIGINT only records that it came; the block asks
    `interrupted()` at its safe points (between chunks, after a chunk is saved)
    and raises `KeyboardInterrupt` there, and leaving the block normally raises
    it if one came. A `KeyboardInterrupt` raised at an arbitrary bytecode --
    in the middle of tracing, or while XLA threads run -- can leave JAX's state
    half-changed and crash the interpreter; this keeps it out of those places.
    A second SIGINT raises at once. Nested blocks share the outermost one's
    record; outside the main thread (where Python runs no signal handlers) the
    block changes nothing and `interrupted()` is always `False`.

    **Returns:** a context manager yielding `interrupted() -> bool`.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    previous = signal.getsignal(signal.SIGINT)
    if isinstance(previous, _Deferred):  # nested: the outer block raises
        yield lambda: previous.pending
        return
    if previous is None:  # a handler installed from C: leave it alone
        yield lambda: False
        return
    handler = _Deferred()
    signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: handler.pending
    finally:
        signal.signal(signal.SIGINT, previous)
    if handler.pending:
        raise KeyboardInterrupt
