"""The house's size budget: every module <= 400 lines, every function <= 60 lines (CI runs this).

An exception needs a line in ALLOWED saying why; anything else over budget fails with one line per offender.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODULE_LINES, FUNCTION_LINES = 400, 60
ALLOWED: dict[str, str] = {
    # "src/mtplm/path.py::function": "why it is longer",
}


def offenders(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent.parent).as_posix() if root.name == "mtplm" else path.as_posix()
        lines = path.read_text().count("\n")
        if lines > MODULE_LINES and rel not in ALLOWED:
            found.append(f"{rel}: {lines} lines > {MODULE_LINES}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                key = f"{rel}::{node.name}"
                if length > FUNCTION_LINES and key not in ALLOWED:
                    found.append(f"{key}: {length} lines > {FUNCTION_LINES}")
    return found


def main() -> int:
    bad = offenders(Path(__file__).resolve().parents[1] / "src" / "mtplm")
    for line in bad:
        print(line)
    print(
        f"size check: {len(bad)} over budget (modules <= {MODULE_LINES} lines, functions <= {FUNCTION_LINES})"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
