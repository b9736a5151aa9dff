"""The package's import graph: one direction, no cycles, no hidden imports, nothing loaded that is not asked for."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "kvcompress"
# Optional dependencies may be imported where they are used, so the package works without them (nltk comes with
# rouge-score, in the eval extra).
OPTIONAL = {"matplotlib", "rouge_score", "nltk", "tqdm", "vllm", "lm_eval", "hypothesis", "kvpress"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(path): ast.parse(path.read_text(), str(path)) for path in PACKAGE.rglob("*.py")}


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _runtime_imports(tree: ast.Module, module: str) -> set[str]:
    """kvcompress modules imported at module level (``if TYPE_CHECKING`` blocks excluded)."""
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcompress"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("kvcompress"))
    return found


def test_no_import_cycle_inside_the_package():
    modules = _modules()
    graph = {name: {dep for dep in _runtime_imports(tree, name) if dep in modules} for name, tree in modules.items()}
    for name in list(graph):  # importing a submodule runs its parent packages first
        parent = name.rpartition(".")[0]
        while parent:
            if parent in graph:
                graph[name].add(parent)
            parent = parent.rpartition(".")[0]
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if dep == node or dep.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def _optional_modules(modules: dict[str, ast.Module]) -> set[str]:
    """Package modules that import an optional dependency at module level (importing them is optional too)."""
    optional = set()
    for name, tree in modules.items():
        for node in tree.body:
            roots = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                roots = [node.module or ""]
            if any(root.split(".")[0] in OPTIONAL for root in roots):
                optional.add(name)
    return optional


def test_imports_inside_functions_are_for_optional_dependencies_only():
    offenders = []
    modules = _modules()
    allowed = OPTIONAL | _optional_modules(modules)
    for name, tree in modules.items():
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    if isinstance(node, ast.Import):
                        roots = [alias.name for alias in node.names]
                    else:
                        roots = [f"{node.module}.{alias.name}" for alias in node.names]
                    if not all(
                        root.split(".")[0] in allowed or root.rpartition(".")[0] in allowed or root in allowed
                        for root in roots
                    ):
                        offenders.append(f"{name}.{function.name}: {ast.unparse(node)}")
    assert offenders == []


def test_importing_the_package_or_building_a_cache_loads_no_other_method():
    code = (
        "import sys, kvcompress\n"
        "from kvcompress.models import tiny_model\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('kvcompress.methods.'))\n"
        "assert loaded() == [], loaded()\n"
        "kvcompress.cache_for(tiny_model(), 'h2o', budget=8)\n"
        "assert loaded() == ['kvcompress.methods.h2o'], loaded()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("core_module", ["contract", "checks", "hashing"])
def test_the_contract_modules_import_nothing_of_kvcompress(core_module):
    tree = ast.parse((PACKAGE / "core" / f"{core_module}.py").read_text())
    assert _runtime_imports(tree, core_module) == set()


def test_core_imports_no_method_and_methods_import_no_consumer():
    consumers = ("kvcompress.eval", "kvcompress.bench", "kvcompress.train", "kvcompress.cli", "kvcompress.generation")
    for name, tree in _modules().items():
        deps = _runtime_imports(tree, name)
        if name.startswith("kvcompress.core"):
            assert not {d for d in deps if d.startswith(("kvcompress.methods", "kvcompress.registry"))}, name
        if name.startswith(("kvcompress.core", "kvcompress.methods", "kvcompress.models")):
            assert not {d for d in deps if d.startswith(consumers)}, name


def test_docstrings_and_docs_point_nowhere_outside_the_repository():
    repository = PACKAGE.parents[1]
    texts = [*PACKAGE.rglob("*.py"), *(repository / "docs").rglob("*.md"), repository / "README.md"]
    outside = [str(path) for path in texts if "../shared" in path.read_text() or "shared/specs" in path.read_text()]
    assert outside == []


def test_no_experiment_script_ships_in_the_package():
    assert not (PACKAGE / "experiments").exists()
    mains = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "parents[" in p.read_text()]
    assert mains == []
