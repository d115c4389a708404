"""The one exception type for user mistakes: the CLI prints its message and exits non-zero, no traceback."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class UserError(ValueError):
    """Bad input from a user: the message says what was wrong and what to do instead."""


class Terminated(BaseException):
    """SIGTERM arrived while a command ran: unwinds like Ctrl-C, so every `with` and `finally` on the way out
    runs (child servers stopped, partial files removed) instead of the process dying where it stood."""


def exit_code(action: Callable[[], int | None], name: str, interrupted: str = "interrupted") -> int:
    """Run a command's action as a user sees it: its own exit code (0 for None), a UserError as one line
    `NAME: error: ...` and exit 2, Ctrl-C as one line and exit 130, SIGTERM as one line and exit 143."""
    try:
        with _sigterm_unwinds():
            return action() or 0
    except UserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises Terminated while the block runs, where nothing else has claimed the signal (Python's
    default lets it kill the process without cleanup). Code that handles SIGTERM itself, like the training
    loop's save-then-stop, installs its own handler inside and restores this one."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def unwind(signum, frame) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
