"""The one exception type for user mistakes: the CLI prints its message and exits non-zero, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(ValueError):
    """Bad input from a user: the message says what was wrong and what to do instead."""


def exit_code(action: Callable[[], int | None], name: str, interrupted: str = "interrupted") -> int:
    """Run a command's action as a user sees it: its own exit code (0 for None), a UserError as one line
    `NAME: error: ...` and exit 2, Ctrl-C as one line and exit 130."""
    try:
        return action() or 0
    except UserError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
