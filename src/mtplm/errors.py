"""The one exception type for user mistakes: the CLI prints its message and exits non-zero, no traceback."""


class UserError(ValueError):
    """Bad input from a user: the message says what was wrong and what to do instead."""
