"""The README's Python snippets name what the package has: every ``packing_hf.X`` exists, and every keyword
passed to a packing_hf config, trainer or collator is one it takes, checked by reading them (a quick check, and
one that also reads a sketch whose ``...`` stands for the user's own arguments). That every snippet runs is
tested by tests/integration/test_readme_runs.py."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import packing_hf

ROOT = Path(__file__).resolve().parents[2]
# the README and the guides in docs/ that continue its Python session
PAGES = (ROOT / "README.md", ROOT / "docs" / "rl.md", ROOT / "docs" / "vlm.md")


def _python_blocks() -> list[tuple[str, str]]:
    """``(where, source)`` of every Python block of :data:`PAGES`; ``where`` is ``"<page>:<line>"``."""
    return [block for page in PAGES for block in _page_blocks(page)]


def _page_blocks(page: Path) -> list[tuple[str, str]]:
    blocks, lines, start = [], None, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if lines is None and line.strip() == "```python":
            lines, start = [], f"{page.relative_to(ROOT)}:{number}"
        elif lines is not None and line.strip() == "```":
            blocks.append((start, "\n".join(lines)))
            lines = None
        elif lines is not None:
            lines.append(line)
    return blocks


def _parse(source: str) -> ast.Module:
    # ", ...)" (the user's other arguments) after keywords is not Python: drop it before parsing
    return ast.parse(re.sub(r",\s*\.\.\.\s*\)", ")", source))


def _accepted(target: object) -> set[str] | None:
    """The keyword names ``target(...)`` takes (None: any)."""
    if dataclasses.is_dataclass(target):
        return {f.name for f in dataclasses.fields(target) if f.init}
    names: set[str] = set()
    classes = target.__mro__ if inspect.isclass(target) else ()
    # a packed trainer binds its stock trainer's signature: read the first class that spells its arguments
    for cls in classes or (target,):
        init = cls.__init__ if inspect.isclass(cls) else cls
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names |= {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return names
    return None


BLOCKS = _python_blocks()


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("start, source", BLOCKS, ids=[f"line{start}" for start, _ in BLOCKS])
def test_readme_snippet_names_exist(start, source):
    tree = _parse(source)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "packing_hf"
        ):
            assert hasattr(packing_hf, node.attr), (
                f"{start}: packing_hf.{node.attr} does not exist"
            )
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        if not (isinstance(owner, ast.Name) and owner.id == "packing_hf"):
            continue
        target = getattr(packing_hf, node.func.attr)
        accepted = _accepted(target)
        if accepted is None:
            continue
        for keyword in node.keywords:
            assert keyword.arg is None or keyword.arg in accepted, (
                f"{start}: packing_hf.{node.func.attr}(...) takes no {keyword.arg}="
            )


def test_the_check_catches_a_misspelt_keyword():
    # negative control: the same walk on a snippet with a keyword no config has
    bad = 'args = packing_hf.TrainingArguments(output_dir="out", max_tokens_per_btach=8192, ...)'
    with pytest.raises(AssertionError, match="max_tokens_per_btach"):
        test_readme_snippet_names_exist(0, bad)
