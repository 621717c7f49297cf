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
            "packing_hf._random_kernels",
            "packing_hf._balance_kernels",
            "packing_hf._rows",
            # per-token loss arithmetic of the loss contract (read by the collator and the trainers)
            "packing_hf._loss",
            # the LM head and its loss in chunks of tokens (pure torch)
            "packing_hf.loss_head",
            # the loss of a packed row cut over a sequence-parallel group: each shard's share (pure torch)
            "packing_hf.shard_loss",
            # data about architectures, read by the attention to refuse models it cannot keep exact
            "packing_hf.registry",
            # the refusal exception, its reason as data (raised by the attention and the trainers)
            "packing_hf.errors",
            "packing_hf.shared_prefix",
            # the padded <-> packed layout, used by the data layer, the attention and the architectures
            "packing_hf.padding",
            # values derived from tensors, cached per tensor object and version (attention, architectures)
            "packing_hf._cache",
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
            "packing_hf.cost",
            # model FLOPs of a step (per-sample attention), MFU peaks: counted with the cost model's coefficients
            "packing_hf.flops",
            "packing_hf.preference",
            "packing_hf.preference_layout",
            "packing_hf.pair_rows",
            "packing_hf.unpaired",
            "packing_hf.multimodal",
            "packing_hf.rollouts",
            "packing_hf.prefix_tree",
            # a micro-batch as one prefix-tree row, its targets as (row, target, weight) pairs
            "packing_hf.tree_collator",
            # planning by computed tokens: samples grouped by shared prefixes (read by the sampler)
            "packing_hf.prefix_plan",
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


# docs/architecture.md, "Style measures", states the same measure
MAX_FUNCTION_LINES = 80


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """``(name, line, length)`` of every function and method in ``source``. The length is the function's physical
    lines, from its ``def`` to its last line, less its docstring: blank and comment lines count, and a nested
    function counts both on its own and inside the function that holds it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if ast.get_docstring(node, clean=False) is not None:
            length -= node.body[0].end_lineno - node.body[0].lineno + 1
        found.append((node.name, node.lineno, length))
    return found


def long_functions(sources: dict[str, str]) -> list[str]:
    """``file:line name (length)`` of every function over ``MAX_FUNCTION_LINES`` in ``{file name: source}``,
    the numba kernels (``*_kernels.py``) left out: a compiled loop is written as one function."""
    return [
        f"{file}:{line} {name} ({length} lines)"
        for file, source in sources.items()
        if not file.endswith("_kernels.py")
        for name, line, length in function_lengths(source)
        if length > MAX_FUNCTION_LINES
    ]


def test_no_function_over_80_lines():
    """A function over 80 lines of code does several things: split it by phase, as ``TrainJob`` / ``TrlJob`` are."""
    long = long_functions({str(p.relative_to(ROOT)): p.read_text() for p in MODULES.values()})
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code (split them):\n" + "\n".join(long)


def test_the_function_measure_counts_code_not_docstrings():
    """The checker itself (negative control): a synthetic 81-line function is flagged, one of 80 lines is not, nor
    is the 81-line one in a numba kernels module; a docstring does not count, comments, blank lines and a nested
    function do."""
    statements = [f"    x{i} = {i}\n" for i in range(80)]
    over = "def over():\n" + "".join(statements)
    at_limit = "def at_limit():\n" + "".join(statements[1:])
    assert function_lengths(over) == [("over", 1, 81)]
    assert long_functions({"a.py": over, "b.py": at_limit, "_c_kernels.py": over}) == ["a.py:1 over (81 lines)"]
    documented = 'def documented():\n    """One.\n\n    Two.\n    """\n' + "".join(statements[1:])
    assert function_lengths(documented) == [("documented", 1, 80)]
    padded = "def padded():\n    # why\n\n    def inner():\n        return 1\n\n    return inner\n"
    assert sorted(function_lengths(padded)) == [("inner", 4, 2), ("padded", 1, 7)]


# -- who may patch third-party objects -------------------------------------------------------------------
# A *patch site* changes an object that belongs to someone else: the user's model, its config, the
# trainer's accelerator, a transformers module. The AST shows four kinds:
# - a call of a hook or switch method on a module: HOOK_METHODS, or ``<X>Interface.register(...)``;
# - ``setattr`` / ``delattr`` on anything but ``self`` / ``cls``;
# - an attribute assigned (or deleted) on a name imported from another package (``transformers.x = ...``);
# - an attribute assigned (or deleted) through one of THIRD_PARTY_NAMES, the names this code base gives the
#   objects it is handed (``model.config.use_cache = ...``, ``self.accelerator.gather = ...``).
HOOK_METHODS = frozenset(
    {
        "register_forward_pre_hook",
        "register_forward_hook",
        "register_full_backward_pre_hook",
        "register_full_backward_hook",
        "register_backward_hook",
        "register_module_forward_pre_hook",
        "register_module_forward_hook",
        "set_attn_implementation",
    }
)
THIRD_PARTY_NAMES = frozenset(
    {"model", "base", "module", "layer", "head", "config", "accelerator", "shard", "trainer", "tokenizer"}
)

# Where patch sites may stand: module (or package) -> why, and how many sites it may hold (None: any).
# docs/architecture.md ("Who patches what") shows the same table.
PATCHING_ALLOWED: dict[str, tuple[str, int | None]] = {
    # the attention registration and the reversible flash-attention patch
    "packing_hf.attention": ("registration, the reversible flash patch", None),
    # hooks on one model instance whose state travels with each call, and their revert()
    "packing_hf.architectures": ("per-instance hooks, reverted by PackingPreparation.revert()", None),
    # the app loads its own model, tokenizer and trainer: it changes only objects it created
    "packing_hf.app": ("objects the app itself loaded", None),
    # check_packing restores the train/eval flags it changed (a context manager), on the model it checks
    "packing_hf.verify": ("train/eval flags restored in a finally", 1),
    # the integrations modules the architecture doc names: a trainer's model switched to packing_hf's attention
    # and given back (the session, the pre-flight), forward hooks translating a packed batch and the trainer's
    # accelerator gather (the adapters)
    "packing_hf.integrations.session": ("the attention switch and use_cache, given back", None),
    "packing_hf.integrations.preflight": ("the pre-flight's attention switch", None),
    "packing_hf.integrations.adapters": ("model adapters: forward hooks on the trainer's models", None),
    # under DeepSpeed ZeRO-3 the chunked loss runs as a call of lm_head (its forward set on the instance for the
    # call, deleted in a finally), so that DeepSpeed's hooks gather the partitioned weight for it and its backward
    "packing_hf.integrations.chunked_head": ("lm_head's forward for one call under ZeRO-3, deleted after", 2),
    "packing_hf.integrations.accelerator": (
        "the trainer's own accelerator gather and prepared batch shard, adapted for its life",
        None,
    ),
}  # fmt: skip


def _imported_names(tree: ast.AST) -> set[str]:
    """Names bound by an import of another package (absolute, not packing_hf)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(
                (a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("packing_hf")
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and not (node.module or "").startswith("packing_hf")
        ):
            names.update(a.asname or a.name for a in node.names)
    return names


def _chain(node: ast.expr) -> list[str]:
    """``a.b.c`` -> ``["a", "b", "c"]`` (empty where the chain does not start at a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def patch_sites(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every patch site in ``source`` (see the comment above HOOK_METHODS)."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            owner = _chain(func.value) if isinstance(func, ast.Attribute) else []
            if (
                (isinstance(func, ast.Attribute) and func.attr in HOOK_METHODS)
                or (
                    isinstance(func, ast.Attribute)
                    and func.attr == "register"
                    and owner
                    and owner[-1].endswith("Interface")
                )
                or (
                    isinstance(func, ast.Name)
                    and func.id in ("setattr", "delattr")
                    and node.args
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
                )
            ):
                sites.append((node.lineno, ast.unparse(node)))
        targets = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store | ast.Del):
                    owner = _chain(sub.value)
                    if owner and (owner[0] in imported or THIRD_PARTY_NAMES.intersection(owner)):
                        sites.append((node.lineno, ast.unparse(sub)))
    return sorted(sites)


def _allowance(module: str) -> tuple[str, tuple[str, int | None]] | None:
    for prefix, allowed in PATCHING_ALLOWED.items():
        if module == prefix or module.startswith(prefix + "."):
            return prefix, allowed
    return None


def test_only_the_allowed_modules_patch_third_party_objects():
    wrong = []
    for module, path in MODULES.items():
        sites = patch_sites(path.read_text())
        if not sites:
            continue
        found = _allowance(module)
        limit = found[1][1] if found else 0
        if limit is not None and len(sites) > limit:
            where = "\n".join(f"  {path.relative_to(ROOT)}:{line}: {code}" for line, code in sites)
            wrong.append(f"{module}: {len(sites)} patch sites, {limit} allowed\n{where}")
    assert not wrong, (
        "third-party objects patched outside attention/ and architectures/ (docs/architecture.md, 'Who patches "
        "what'): move the change there, or make it an attribute of your own object\n" + "\n".join(wrong)
    )


def test_the_counted_allowances_are_exact():
    """An allowance with a count shrinks with the code: a moved site must leave the table too."""
    for prefix, (_, limit) in PATCHING_ALLOWED.items():
        if limit is None:
            continue
        found = sum(
            len(patch_sites(p.read_text()))
            for m, p in MODULES.items()
            if (_allowance(m) or ("",))[0] == prefix
        )
        assert found == limit, f"{prefix} holds {found} patch sites, PATCHING_ALLOWED says {limit}: update it"


def test_architecture_doc_shows_the_patching_allowances():
    text = ARCHITECTURE_DOC.read_text()
    missing = [
        prefix for prefix in PATCHING_ALLOWED if f"`{prefix}`" not in text.split("## Who patches what")[-1]
    ]
    assert "## Who patches what" in text and not missing, (
        f"docs/architecture.md lacks the allowances of {missing}"
    )


def test_the_patch_scan_sees_every_kind_of_site():
    """The scanner itself (negative control): each kind of site is found, plain attributes of one's own are not."""
    source = (
        "import transformers\n"
        "from accelerate import Accelerator\n"
        "def f(model, self, result):\n"
        "    model.register_forward_hook(print)\n"  # a hook
        "    model.base_model.set_attn_implementation('sdpa')\n"  # a switch
        "    AttentionInterface.register('x', print)\n"  # a registration
        "    setattr(model, 'forward', print)\n"  # setattr on another object
        "    transformers.modeling_utils.x = 1\n"  # a module attribute
        "    Accelerator.gather = print\n"  # an imported class
        "    self.accelerator.gather = print\n"  # a handed object, through self
        "    model.config.use_cache = False\n"  # a handed object
        "    del model.config.x\n"
        "    setattr(self, 'x', 1)\n"  # one's own: not a site
        "    self.x = 1\n"
        "    result.total = 3\n"
    )
    lines = [line for line, _ in patch_sites(source)]
    assert lines == [4, 5, 6, 7, 8, 9, 10, 11, 12]


# -- who reads the parallel layout -----------------------------------------------------------------------
# The run's parallel layout has one owner: integrations/parallel.py (the ParallelPlan a packed trainer builds with
# its accelerator, and the functions that read a configuration's sizes), with integrations/launcher.py (what a
# launcher was asked for against what its processes got). Every other integrations module asks the plan
# (``self.parallel_plan.world_size``, ``plan.sp_size``) or a function of parallel.py, never the arguments,
# accelerate, torch.distributed or the environment: a size read there can disagree with the plan (accelerate
# miscounts DeepSpeed's CPU group; DataParallel's devices are not processes). A *layout read* is:
# - an attribute read of a size (PARALLEL_SIZES) on anything but the plan (an owner named in PLAN_NAMES);
# - a call of ``get_world_size`` (torch.distributed's, or any other);
# - a size named as a string (``getattr(args, "sp_size")``, ``os.environ["WORLD_SIZE"]``) or as a keyword
#   (``ParallelismConfig(sp_size=2)``).
LAYOUT_OWNERS = frozenset({"packing_hf.integrations.parallel", "packing_hf.integrations.launcher"})
PARALLEL_SIZES = frozenset(
    {
        "sp_size",
        "cp_size",
        "tp_size",
        "dp_shard_size",
        "dp_replicate_size",
        "world_size",
        "num_processes",
        "get_world_size",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    }
)
PLAN_NAMES = frozenset({"parallel_plan", "plan"})


def layout_reads(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every layout read in ``source`` (see the comment above LAYOUT_OWNERS)."""
    reads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in PARALLEL_SIZES:
            owner = _chain(node.value)
            if not owner or owner[-1] not in PLAN_NAMES or node.attr == "get_world_size":
                reads.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Name) and node.id == "get_world_size":
            reads.append((node.lineno, node.id))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in PARALLEL_SIZES:
            reads.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.keyword) and node.arg in PARALLEL_SIZES:
            reads.append((node.value.lineno, f"{node.arg}=..."))
    return sorted(reads)


def test_only_the_plan_reads_the_parallel_layout_inside_integrations():
    wrong = [
        f"  {path.relative_to(ROOT)}:{line}: {code}"
        for module, path in MODULES.items()
        if module.startswith("packing_hf.integrations.") and module not in LAYOUT_OWNERS
        for line, code in layout_reads(path.read_text())
    ]
    assert not wrong, (
        "parallel sizes or world sizes read outside integrations/parallel.py and launcher.py: ask the run's "
        "ParallelPlan (self.parallel_plan) or a function of parallel.py instead\n" + "\n".join(wrong)
    )


def test_the_layout_scan_sees_every_kind_of_read():
    """The scanner itself (negative control): each kind of read is found, the plan's attributes are not."""
    source = (
        "import os\n"
        "import torch.distributed as dist\n"
        "from torch.distributed import get_world_size\n"
        "def f(self, args, accelerator, plan):\n"
        "    args.world_size\n"  # the arguments' count of processes
        "    self.args.parallelism_config.sp_size\n"  # a configuration's size
        "    accelerator.num_processes\n"  # accelerate's count
        "    dist.get_world_size()\n"  # torch.distributed's
        "    get_world_size()\n"
        "    os.environ['WORLD_SIZE']\n"  # the launcher's
        "    getattr(args, 'dp_shard_size', 1)\n"
        "    ParallelismConfig(dp_replicate_size=2)\n"
        "    plan.get_world_size()\n"  # not a plan attribute: a read whatever its owner
        "    self.parallel_plan.world_size\n"  # the plan's: not reads
        "    plan.sp_size\n"
        "    sp_size = 2\n"  # a local of that name reads nothing
        "    'sp_size=2 needs max_tokens_per_batch'\n"  # words in a message
    )
    lines = [line for line, _ in layout_reads(source)]
    assert lines == [5, 6, 7, 8, 9, 10, 11, 12, 13]
