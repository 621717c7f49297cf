"""The package layout: layers import only downwards, no import circle, and docs/architecture.md lists the tree.

Every ``import`` statement of every module counts, including imports inside functions: a lazy import
hides a circle from Python at import time, not from this test.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packing_hf"
ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"

# Layers, bottom up. A module may import modules of its own layer or below, never above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "core",
        (
            "packing_hf._limits",
            "packing_hf.varlen",
            "packing_hf.overflow",
            "packing_hf._binpack",
            "packing_hf._binpack_kernels",
            "packing_hf._rows",
            # per-token loss arithmetic of the loss contract (read by the collator and the trainers)
            "packing_hf._loss",
            # the LM head and its loss in chunks of tokens (pure torch)
            "packing_hf.loss_head",
            # data about architectures, read by the attention to refuse models it cannot keep exact
            "packing_hf.registry",
            # the refusal exception, its reason as data (raised by the attention and the trainers)
            "packing_hf.errors",
            "packing_hf.shared_prefix",
        ),
    ),
    (
        "data",
        (
            "packing_hf.strategies",
            "packing_hf.collator",
            "packing_hf.fixed",
            "packing_hf.sampler",
            "packing_hf._epoch_plan",
            "packing_hf.preference",
            "packing_hf.pair_rows",
            "packing_hf.unpaired",
            "packing_hf.multimodal",
            "packing_hf.rollouts",
            "packing_hf.streaming",
        ),
    ),
    ("attention", ("packing_hf.attention",)),
    ("check", ("packing_hf.verify",)),
    ("architectures", ("packing_hf.architectures",)),
    ("integrations", ("packing_hf.integrations",)),
    ("app", ("packing_hf.app",)),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS here and to docs/architecture.md")


def resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The packing_hf modules an import statement loads (a package counts as its __init__)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            package = importer if MODULES[importer].name == "__init__.py" else importer.rsplit(".", 1)[0]
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        # `from pkg import submodule` loads the submodule too
        names = [base] + [f"{base}.{alias.name}" for alias in node.names]
    return [n for n in names if n in MODULES]


def imports_of(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(resolve(module, node))
    found.discard(module)
    return found


def graph() -> dict[str, set[str]]:
    # the package facade (packing_hf/__init__.py) only names things lazily
    return {m: imports_of(m) - {"packing_hf"} for m in MODULES if m != "packing_hf"}


def test_every_module_belongs_to_a_layer():
    for module in graph():
        layer_of(module)


def test_layers_import_only_downwards():
    wrong = [
        f"{importer} ({LAYERS[layer_of(importer)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})"
        for importer, imported_set in graph().items()
        for imported in sorted(imported_set)
        if layer_of(imported) > layer_of(importer)
    ]
    assert not wrong, "imports pointing up the layers:\n" + "\n".join(wrong)


def own_package(module: str, imported: str) -> bool:
    """``imported`` is the ``__init__`` of ``module``'s own package (which imports ``module`` back)."""
    return (
        imported == module.rsplit(".", 1)[0]
        and imported in MODULES
        and MODULES[imported].name == "__init__.py"
    )


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports, or None. A module importing names from its own package ``__init__`` is not
    followed: that edge only reaches names the ``__init__`` re-exports from the package's modules, whose own
    imports are followed anyway."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if own_package(node, nxt):
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if state.get(nxt) is None and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for module in sorted(edges):
        if state.get(module) is None and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checks_see_circles_and_lazy_imports():
    """The checker itself: a circle is found, and an import inside a function is an edge like any other."""
    assert find_cycle({"x.a": {"x.b"}, "x.b": {"x.c"}, "x.c": {"x.a"}}) == ["x.a", "x.b", "x.c", "x.a"]
    assert find_cycle({"x.a": {"x.b"}, "x.b": set()}) is None
    lazy = ast.parse("def f():\n    from ..varlen import INT32_MAX\n")
    found = {
        n
        for node in ast.walk(lazy)
        if isinstance(node, ast.ImportFrom)
        for n in resolve("packing_hf.attention.guards", node)
    }
    assert found == {"packing_hf.varlen"}
    assert layer_of("packing_hf.app.cli") > layer_of("packing_hf.collator")


def documented_modules() -> list[str]:
    return re.findall(r"^\| `(packing_hf[\w.]*)` \|", ARCHITECTURE_DOC.read_text(), flags=re.M)


def test_architecture_doc_lists_every_module_and_each_imports():
    listed = documented_modules()
    assert listed, "docs/architecture.md lists no module (rows look like | `packing_hf.x` | ... |)"
    missing = sorted(set(MODULES) - set(listed) - {"packing_hf"})
    assert not missing, f"modules missing from docs/architecture.md: {missing}"
    gone = sorted(set(listed) - set(MODULES))
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"
    for name in listed:
        importlib.import_module(name)


MAX_LINES = 700


def test_no_module_over_700_lines():
    """A module over 700 lines holds more than one concern: split it (every module, no exceptions)."""
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
