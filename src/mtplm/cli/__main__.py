"""`python -m mtplm.cli` (and `torchrun -m mtplm.cli`): the same as the `mtplm` command."""

from __future__ import annotations

import sys

from mtplm.cli import main

sys.exit(main())
