"""The one default the CLI holds itself: the model a command uses when none is named."""

from __future__ import annotations

DEFAULT_CHECKPOINT = "smollm2-135m-mtp"  # the converted default model shipped inside the package
