"""The constraint a command line asks for (options.add_constraint_arguments: --json-schema FILE, --regex R,
--grammar FILE), read into a constraint.Spec."""

from __future__ import annotations

from mtplm.decode.constraints.constraint import Spec, json_schema
from mtplm.errors import UserError


def constraint_spec(args):
    """The constraint the options ask for (a decode.constraint.Spec), or None; UserError for a bad one."""
    if getattr(args, "regex", None) is not None:
        return Spec("regex", args.regex, "--regex")
    for option, path in (
        ("--json-schema", getattr(args, "json_schema", None)),
        ("--grammar", getattr(args, "grammar", None)),
    ):
        if path is None:
            continue
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise UserError(f"{option}: cannot read {path}: {reason}") from None
        return json_schema(text, option) if option == "--json-schema" else Spec("grammar", text, option)
    return None
