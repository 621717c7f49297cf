"""List the functions longer than a number of lines (default 80) in a package.

Usage: ``python tools/long_functions.py [--max-lines 80] [package_dir ...]``; prints
``path:line name lines`` for each, longest first, then the count. A function's length is
``end_lineno - lineno + 1`` of its ``def`` (decorators and docstring included); nested
functions count on their own and inside their parent.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def long_functions(root: Path, max_lines: int) -> list[tuple[int, str, str]]:
    """``(lines, "path:line", qualified name)`` of every function over ``max_lines`` below ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        lines = child.end_lineno - child.lineno + 1
                        if lines > max_lines:
                            found.append((lines, f"{path}:{child.lineno}", name))
                    stack.append((child, f"{name}."))
                else:
                    stack.append((child, prefix))
    return sorted(found, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", default=["packing_hf"])
    parser.add_argument("--max-lines", type=int, default=80)
    args = parser.parse_args()
    found = [f for root in args.roots for f in long_functions(Path(root), args.max_lines)]
    for lines, where, name in found:
        print(f"{where} {name} {lines}")
    print(f"{len(found)} functions over {args.max_lines} lines")


if __name__ == "__main__":
    main()
