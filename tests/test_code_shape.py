"""The code's shape, read with `ast`: no function runs past MAX_FUNCTION_LINES, and no two modules of
`hf_concept` import each other, directly or round a longer circle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hf_concept"
CHECKED_FOLDERS = ("src", "benchmarks", "scripts")
# Def line to last line, docstring included: a longer function does more than one job.
MAX_FUNCTION_LINES = 60


def _functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def function_lengths() -> dict[tuple[str, str], int]:
    """(file relative to the root, qualified name) -> lines, for every function of the checked folders."""
    lengths = {}
    for folder in CHECKED_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for name, node in _functions(tree):
                key = (path.relative_to(ROOT).as_posix(), name)
                lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_no_function_is_longer_than_the_limit():
    lengths = function_lengths()
    too_long = [
        f"{path}: {name} has {count} lines"
        for (path, name), count in sorted(lengths.items())
        if count > MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(too_long)


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package; a package is its __init__.py."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def lazy_exports(path: Path) -> dict[str, str] | None:
    """A lazily loading package's `_EXPORTS` (name -> (submodule, its name)) as name -> submodule."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "_EXPORTS" for target in node.targets
        ):
            return {name: module for name, (module, _) in ast.literal_eval(node.value).items()}
    return None


def _from_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The dotted module of `from X import ...` in `module`, a relative X resolved."""
    if not node.level:
        return node.module or ""
    # Relative to the importing module's package (a package's __init__ is its own package).
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def _from_targets(
    base: str, imported: list[str], modules: set[str], lazy: dict[str, dict[str, str]]
) -> list[str]:
    """The modules `from base import <imported>` loads: a name that is a submodule is that submodule; any
    other name comes from `base` itself, or, for a lazy package, from the submodule its `_EXPORTS` names."""
    targets = []
    for name in imported:
        if f"{base}.{name}" in modules:
            targets.append(f"{base}.{name}")
        elif name in lazy.get(base, {}):
            targets.append(f"{base}.{lazy[base][name]}")
        else:
            targets.append(base)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at module level, under `if`, or inside functions."""
    names = module_names()
    lazy = {name: exports for name, path in names.items() if (exports := lazy_exports(path)) is not None}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(name, path.name == "__init__.py", node)
                targets = _from_targets(base, [alias.name for alias in node.names], set(names), lazy)
            else:
                continue
            graph[name].update(target for target in targets if target in names and target != name)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle of imports through the component's first module, as the modules in import order."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                return [*paths[node], start]
            if child not in paths:
                paths[child] = [*paths[node], child]
                frontier.append(child)
    raise AssertionError(f"{component} is not strongly connected")


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    cycles = [" -> ".join(a_cycle(graph, component)) for component in strongly_connected(graph)]
    assert not cycles, "import cycles (move what both sides need into a module below them):\n" + "\n".join(
        cycles
    )


def test_the_import_graph_sees_every_kind_of_import():
    graph = import_graph()
    # Module level, relative (`from .costs import ...`), inside a function, and through the lazy package.
    assert "hf_concept.commands.checks" in graph["hf_concept.commands.generate"]
    assert "hf_concept.planning.costs" in graph["hf_concept.planning.search"]
    assert "hf_concept.commands.demo_lslm" in graph["hf_concept.commands.demo"]
    assert "hf_concept.training.trainer" in graph["hf_concept.commands.demo"]
    assert graph["hf_concept.training"] == set()
