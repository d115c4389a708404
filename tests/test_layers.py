"""The import checks scripts/test.sh runs: no cycle among mtplm's modules (imports inside functions count),
and the check itself fails on a package that has one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "import_cycles.py"


def _cycles(src: Path, package: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(src), package], capture_output=True, text=True, check=False
    )


def test_mtplm_has_no_import_cycle():
    result = _cycles(ROOT / "src", "mtplm")
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("0 import cycles")


def test_a_cycle_through_a_function_level_import_fails_the_check(tmp_path):
    package = tmp_path / "toy"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from toy import low  # a package importing its own submodule: no cycle\n"
    )
    (package / "low.py").write_text(
        "import toy\n\n\ndef late():\n    from .inner.high import f\n    return f\n"
    )
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "high.py").write_text("from toy.low import late\n\n\ndef f():\n    return late\n")
    result = _cycles(tmp_path, "toy")
    assert result.returncode == 1
    assert "cycle of 2: toy.inner.high, toy.low" in result.stdout
    assert "toy.low -> toy.inner.high" in result.stdout and "toy.inner.high -> toy.low" in result.stdout
    (package / "low.py").write_text("def late():\n    return None\n")
    assert _cycles(tmp_path, "toy").returncode == 0
