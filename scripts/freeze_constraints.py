"""Write constraints.txt: the installed version of every package that mtplm and its plot, test and serve
extras pull in (their dependency closure, as this environment resolved it). Run it from a .venv that passed
the tests: `.venv/bin/python scripts/freeze_constraints.py`."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

HEADER = """\
# The versions CI tests: scripts/setup.sh installs mtplm and its extras with `pip install -c constraints.txt`,
# so a fresh machine resolves what CI ran. pyproject.toml keeps the ranges mtplm supports; this file pins one
# tested point of them (scripts/freeze_constraints.py writes it from a .venv that passed the tests).
"""


def closure(name: str, extras: tuple[str, ...], seen: dict[str, tuple[str, str]]) -> None:
    """Add `name` and every installed requirement it has (with `extras`) to `seen`: key -> (name, version)."""
    key = re.sub(r"[-_.]+", "-", name).lower()
    try:
        found = distribution(name)
    except PackageNotFoundError:
        return
    first = key not in seen
    seen.setdefault(key, (found.metadata["Name"], found.version.split("+")[0]))
    environments = [{**default_environment(), "extra": extra} for extra in (*extras, "")]
    for line in found.requires or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if (first or extras) and (marker is None or any(marker.evaluate(env) for env in environments)):
            closure(requirement.name, tuple(requirement.extras), seen)


def main() -> None:
    seen: dict[str, tuple[str, str]] = {}
    closure("mtplm", ("plot", "test", "serve", "bench"), seen)
    seen.pop("mtplm")
    pins = [f"{name}=={version}" for name, version in sorted(seen.values(), key=lambda item: item[0].lower())]
    target = Path(__file__).resolve().parent.parent / "constraints.txt"
    target.write_text(HEADER + "\n".join(pins) + "\n")
    print(f"{target}: {len(pins)} pins")


if __name__ == "__main__":
    main()
