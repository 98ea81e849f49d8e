"""The package's one-way stack (docs/architecture.md, "The stack"): every import points down or sideways, never
up; no import circles; imports at the top of a module except for an optional dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "verispec"

# bottom to top; a module may import its own layer and the ones below
LAYERS = [
    ["config", "spec_config", "sampling_params", "outputs", "progress", "metrics", "workloads", "plot"],
    ["kernels"],
    ["distributed"],
    ["layers"],
    ["models"],
    ["loader", "tokenizer", "drafts"],
    ["request"],
    ["runner"],
    ["sample"],
    ["proposers"],
    ["planner"],
    ["engine"],
    ["llm"],
    ["server", "bench", "audit", "train", "cli", "__main__", "__init__"],
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
# imports inside functions, each for a dependency that may be missing (Triton)
OPTIONAL = {("verispec.kernels.cuda_ops", "verispec.kernels.cuda_kernels")}


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, bool]]:
    """(imported verispec module, at the top of the module) for every import statement of `name`."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body} | {
        id(c) for n in tree.body if isinstance(n, (ast.If, ast.Try)) for c in ast.walk(n)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]
            if t.startswith("verispec") and t != name:
                out.append((t, id(node) in top))
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    return RANK[parts[1] if len(parts) > 1 else "__init__"]


def test_every_package_has_a_layer():
    assert sorted({m.split(".")[1] if "." in m else "__init__" for m in MODULES} - set(RANK)) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str):
    up = [t for t, _ in _imports(module) if _layer(t) > _layer(module)]
    assert not up, f"{module} imports from a layer above it: {up}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_at_the_top(module: str):
    inner = [t for t, at_top in _imports(module) if not at_top and (module, t) not in OPTIONAL]
    assert not inner, f"{module} imports inside a function: {inner}"


def test_no_import_circles():
    graph = {m: {t for t, _ in _imports(m)} for m in MODULES}
    # the package root re-exports the API from the top layer; every module's import runs it first
    graph["verispec"] = set()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t) :] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_fit_on_a_screen(module: str):
    """No function over 80 lines: a longer one is split into named steps."""
    tree = ast.parse(MODULES[module].read_text())
    long = [
        f"{n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80
    ]
    assert not long, f"{module}: {long}"
