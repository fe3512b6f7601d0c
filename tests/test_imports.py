"""The package's structure, kept honest: no import circles between modules, layers import downward only, and no
library module imports a command line. The layer order is the one docs/concepts.md ("Layers") writes down.

Every `import` of a vlmrl module counts, at module level and inside functions alike (a lazy import is still a
dependency; it only hides a circle until some call order trips it). Importing `vlmrl.a.b` runs `vlmrl/a/__init__.py`
first, but that implicit parent import is not an edge: `from vlmrl.a import X` (the package's own names) is.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vlmrl

# Lowest first, each as (the name docs/concepts.md gives it, its module prefixes). A module belongs to the layer of the
# longest prefix that names it; it may import its own layer's modules and any layer below. Entries of one layer
# separated by "|" sit side by side: neither imports the other. The package itself ("vlmrl") names only its
# __init__: a module at the package root is placed by its own name, so a new one cannot land in the lowest layer
# unseen (resolving a model reference once sat there as vlmrl/preflight.py; it is models/preflight.py).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors/configlib", ("vlmrl", "vlmrl.errors", "vlmrl.configlib", "vlmrl.config", "vlmrl.deadlines",
                          "vlmrl.references", "vlmrl.rundir", "vlmrl.progress", "vlmrl.cache",
                          "vlmrl.allocator", "vlmrl.optim", "vlmrl.recipes")),
    ("data", ("vlmrl.data",)),
    ("models", ("vlmrl.models",)),
    ("rollout | rewards | algorithms", ("vlmrl.rollout", "|", "vlmrl.rewards", "|", "vlmrl.algorithms")),
    ("agent", ("vlmrl.agent",)),
    ("eval", ("vlmrl.eval",)),
    ("trainer", ("vlmrl.trainer",)),
    ("reclip", ("vlmrl.reclip",)),
    ("serve", ("vlmrl.serve",)),
    ("cli", ("vlmrl.cli", "vlmrl.__main__")),
]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under `root` (the package folder named `package`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """{imported module of `modules`: first line} for every import statement in the file, wherever it stands."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - (node.level - (1 if is_package else 0))]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import sub` imports the submodule `pkg.sub`; `from pkg import name` the package itself
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import vlmrl.a.b.attr` style: the deepest real module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_around(group, graph) for group in groups]


def _path_around(group: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest circle from the group's first module back to itself, within the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return group  # unreachable for a strongly connected group


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> tuple[int, str] | None:
    """(rank, the prefix that placed it): the longest prefix of `module` among the layers' entries; None when no
    entry places it. A package's own name (an entry without a dot) places only the package's __init__."""
    best: tuple[int, str] | None = None
    for rank, (_, entries) in enumerate(layers):
        for prefix in entries:
            if prefix == "|" or not (module == prefix or "." in prefix and module.startswith(prefix + ".")):
                continue
            if best is None or len(prefix) > len(best[1]):
                best = (rank, prefix)
    return best


def _side_by_side(rank: int, a: str, b: str, layers: list[tuple[str, tuple[str, ...]]]) -> bool:
    """True when prefixes `a` and `b` sit in different "|"-separated slots of layer `rank`."""
    slot, slots = 0, {}
    for entry in layers[rank][1]:
        if entry == "|":
            slot += 1
        else:
            slots[entry] = slot
    return slots[a] != slots[b]


def is_cli(module: str) -> bool:
    return module.rpartition(".")[2] in ("cli", "__main__")


def violations(graph: dict[str, dict[str, int]], layers: list[tuple[str, tuple[str, ...]]],
               files: dict[str, Path]) -> list[str]:
    """Every module no layer places, every import from a lower layer to a higher one, between side-by-side parts of
    a layer, and from a library module into a command line, as one line naming both modules."""
    place = {module: layer_of(module, layers) for module in graph}
    out = [f"{files[module]}: {module} is in no layer: place it in LAYERS (tests/test_imports.py) and in "
           f"docs/concepts.md (Layers)" for module in sorted(graph) if place[module] is None]
    for source, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            if place[source] is None or place.get(target) is None:
                continue  # reported above
            (rank, prefix), (target_rank, target_prefix) = place[source], place[target]
            where = f"{files[source]}:{line}"
            if target_rank > rank:
                out.append(f"{where}: {source} (layer {layers[rank][0]}) imports {target} (layer "
                           f"{layers[target_rank][0]}), a higher layer; layers import downward only (docs/concepts.md)")
            elif target_rank == rank and _side_by_side(rank, prefix, target_prefix, layers):
                out.append(f"{where}: {source} imports {target}: {prefix} and {target_prefix} sit side by side in "
                           f"one layer and do not import each other (docs/concepts.md)")
            elif is_cli(target) and not is_cli(source):
                out.append(f"{where}: {source} imports the command line {target}; library modules never import a "
                           f"CLI (move what both need into a module below them)")
    return out


def check(root: Path, package: str, layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    graph = import_graph(root, package)
    files = {name: path.relative_to(root.parent) for name, path in module_files(root, package).items()}
    problems = [f"import circle: {' -> '.join(circle)}" for circle in circles(graph)]
    return problems + violations(graph, layers, files)


def test_the_package_has_no_import_circle_and_imports_downward_only():
    problems = check(Path(vlmrl.__file__).parent, "vlmrl", LAYERS)
    assert not problems, "\n".join(problems)


def test_docs_write_down_the_same_layers():
    text = (Path(vlmrl.__file__).parent.parent / "docs" / "concepts.md").read_text()
    order = " → ".join(name for name, _ in LAYERS)
    assert f"\n{order}\n" in text, f"docs/concepts.md (Layers) should give the order as in tests/test_imports.py:\n{order}"
    for prefix in LAYERS[0][1][1:]:
        short = prefix.removeprefix("vlmrl.")
        assert f"`{short}.py`" in text or f"`{short}` folder" in text, f"docs/concepts.md does not place {prefix}"


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for folder in [p for p in root.rglob("*") if p.is_dir()]:
        (folder / "__init__.py").touch()
    return root


def test_the_check_finds_a_circle_hidden_in_a_function_and_names_both_modules(tmp_path):
    root = _package(tmp_path, {"low/a.py": "from pkg.low import b\n",
                               "low/b.py": "def f():\n    from .a import x\n"})
    problems = check(root, "pkg", [("low", ("pkg", "pkg.low"))])
    assert problems == ["import circle: pkg.low.a -> pkg.low.b -> pkg.low.a"]


def test_the_check_refuses_an_upward_import_a_side_import_and_a_library_importing_a_cli(tmp_path):
    root = _package(tmp_path, {"low.py": "def f():\n    import pkg.high.x\n",
                               "high/x.py": "",
                               "high/w.py": "from . import cli\n",
                               "high/cli.py": "from pkg.high import x\n",
                               "side/y.py": "from pkg.other import z\n",
                               "other/z.py": ""})
    layers = [("low", ("pkg", "pkg.low")), ("side | other", ("pkg.side", "|", "pkg.other")), ("high", ("pkg.high",))]
    assert check(root, "pkg", layers) == [
        "pkg/high/w.py:1: pkg.high.w imports the command line pkg.high.cli; library modules never import a CLI "
        "(move what both need into a module below them)",
        "pkg/low.py:2: pkg.low (layer low) imports pkg.high.x (layer high), a higher layer; layers import "
        "downward only (docs/concepts.md)",
        "pkg/side/y.py:1: pkg.side.y imports pkg.other.z: pkg.side and pkg.other sit side by side in one layer and "
        "do not import each other (docs/concepts.md)",
    ]


def test_a_module_at_the_package_root_is_placed_by_name_not_by_the_package(tmp_path):
    """The lowest layer names its root modules one by one: a new one (as vlmrl/preflight.py was, resolving model
    references for models/cli.py) is refused until someone decides its layer."""
    root = _package(tmp_path, {"errors.py": "", "lookup.py": "from pkg import errors\n",
                               "models/cli.py": "def f():\n    from pkg.lookup import x\n"})
    layers = [("base", ("pkg", "pkg.errors")), ("models", ("pkg.models",))]
    assert check(root, "pkg", layers) == [
        "pkg/lookup.py: pkg.lookup is in no layer: place it in LAYERS (tests/test_imports.py) and in "
        "docs/concepts.md (Layers)"]
    assert check(root, "pkg", [("base", ("pkg", "pkg.errors", "pkg.lookup")), layers[1]]) == []
