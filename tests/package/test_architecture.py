"""The layering that the package's structure promises, checked from the source: no import cycles among stoker's
modules (imports inside functions count: a cycle hidden there is still a cycle) and internal imports at the top of
files, and every import pointing down the layers that docs/architecture.md draws. (That the loop never branches on the
distributed backend is checked in tests/unit/test_distributed_backends.py.)"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "stoker"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    base = PACKAGE.parent.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> tuple[set[str], list[str]]:
    """(stoker modules this module imports anywhere, 'module:line' of those imported inside functions)."""
    name, tree = _module_name(path), ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def targets(node: ast.ImportFrom) -> list[str]:
        if node.level:
            base = package[: len(package) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if not module.startswith("stoker"):
            return []
        subs = [f"{module}.{a.name}" for a in node.names if _is_module(f"{module}.{a.name}")]
        return subs if len(subs) == len(node.names) else [module, *subs]

    found, inside = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.update(targets(node))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("stoker"))
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and targets(node):
                inside.append(f"{name}:{node.lineno}")
    return found - {name}, inside


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    graph, inside = {}, []
    for path in sorted(PACKAGE.rglob("*.py")):
        deps, lazy = _imports(path)
        graph[_module_name(path)] = deps
        inside += lazy
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}, inside


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycles_among_stoker_modules():
    graph, _ = _graph()
    assert len(graph) > 20  # the walk found the package
    assert _cycles(graph) == []


def test_internal_imports_are_at_the_top_of_files():
    _, inside = _graph()
    assert inside == [], f"stoker modules imported inside functions: {inside}"


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check itself: two modules importing each other (one of them inside a function) are a cycle."""
    package = tmp_path / "stoker"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph, inside = _graph()
    assert _cycles(graph) == [["stoker.a", "stoker.b"]] and inside == ["stoker.b:2"]


# docs/architecture.md's layers (test_docs.py checks its table against this tuple), top to bottom: a module may
# import its own layer's modules and any layer below, never one above. Each module is in the first layer one of
# whose prefixes it starts with.
LAYERS = (
    ("entry points", ("stoker", "stoker.cli", "stoker.recipes")),
    ("the Trainer", ("stoker.trainer", "stoker.transformers_surface", "stoker.trainer_checks", "stoker.seq2seq",
                     "stoker.hp_search")),
    ("the Trainer's services", ("stoker.checkpointer", "stoker.rollback", "stoker.run", "stoker.report", "stoker.lora",
                                "stoker.preflight")),
    ("callbacks", ("stoker.callbacks",)),
    ("arguments", ("stoker.arguments",)),
    ("helpers", ("stoker.attention", "stoker.background_save", "stoker.checkpoint_format", "stoker.compilation",
                 "stoker.data", "stoker.diagnostics", "stoker.distributed", "stoker.evaluation", "stoker.float8",
                 "stoker.gguf", "stoker.goodput", "stoker.log", "stoker.step", "stoker.loss", "stoker.memory_plan",
                 "stoker.muon", "stoker.optim", "stoker.outputs", "stoker.packing", "stoker.requirements",
                 "stoker.sdpa_mask", "stoker.synthetic_tasks", "stoker.tracking")),
    ("errors", ("stoker.errors",)),
)


def _layer(module: str) -> int:
    exact = [i for i, (_, names) in enumerate(LAYERS) if module in names]
    nested = [i for i, (_, names) in enumerate(LAYERS) for n in names if n != "stoker" and module.startswith(n + ".")]
    found = exact or nested
    assert found, f"{module} is in no layer of LAYERS (docs/architecture.md)"
    return found[0]


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
            for m, deps in sorted(graph.items()) for d in sorted(deps) if _layer(d) < _layer(m)]


def test_imports_point_down_the_layers():
    graph, _ = _graph()
    assert _upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    """The check itself: a helper that imports the Trainer is named."""
    graph = {"stoker.trainer": {"stoker.optim"}, "stoker.optim": {"stoker.trainer"}}
    assert _upward_imports(graph) == ["stoker.optim (helpers) imports stoker.trainer (the Trainer)"]
