"""What differs between the Python versions mtplm supports (3.10 and later): TOML parsing is the standard
library's tomllib from 3.11, and the tomli backport (the same API, a dependency only there) on 3.10."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["tomllib"]
