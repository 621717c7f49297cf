"""Functions longer than a limit in a package: total lines, and lines without the docstring.

python tools/long_functions.py packing_hf --over 80
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def long_functions(root: Path, over: int) -> list[tuple[int, int, str]]:
    """``(lines, lines without the docstring, "path:line name")`` of every function longer than ``over`` lines
    either way, longest first."""
    rows = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            total = node.end_lineno - node.lineno + 1
            code = total
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
                if isinstance(first.value.value, str):
                    code -= first.end_lineno - first.lineno + 1
            if total > over:
                rows.append((total, code, f"{path}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--over", type=int, default=80)
    args = parser.parse_args()
    rows = long_functions(args.root, args.over)
    for total, code, where in rows:
        print(f"{total:4d} {code:4d}  {where}")
    print(
        f"{len(rows)} functions over {args.over} lines; {sum(code > args.over for _, code, _ in rows)} without docstrings"
    )


if __name__ == "__main__":
    main()
