"""The folder tree is the architecture (../shared/DESIGN.md, docs/architecture.md): these tests hold the code to it.

Read from the source with `ast` (nothing is imported):
- every `relayrl` import points down the layer order, or stays inside its own folder;
- no import circle between modules, counting imports inside functions and under TYPE_CHECKING;
- a `relayrl` import inside a function is the exception (listed below, each with its reason);
- no module over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "relayrl"

# DESIGN.md's import order, lowest first. A module may import its own folder and any lower layer.
LAYER = {
    "config": 1,
    "algorithms": 1,
    "rollout": 1,
    "data": 2,
    "models": 2,
    "agents": 3,
    "tasks": 4,
    "training": 5,
    "distributed": 6,
    "workers": 6,
    "trainers": 7,
    "apps": 8,
    "cli": 8,
    "experimental": 8,
}

# In-function relayrl imports that are there on purpose: module -> reason. Everything else goes at the top.
IN_FUNCTION_ALLOWED: dict[str, str] = {}

MAX_LINES = 500


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported dotted name lives in (a name inside a module resolves to that module)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(path: Path, known: dict[str, Path], root: Path = PACKAGE.parent) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every relayrl import of one file."""
    tree = ast.parse(path.read_text())
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if not t.startswith("relayrl."):
                continue
            target = resolve(t, known)
            if target is not None and target != me:
                out.append((target, node.lineno, id(node) in in_function))
    return out


def layer_of(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return parts[1], LAYER[parts[1]]


def test_every_folder_has_a_layer() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert folders <= set(LAYER), (
        f"folders without a layer in DESIGN.md's order: {sorted(folders - set(LAYER))}"
    )


def test_imports_point_down() -> None:
    known = modules()
    upward = []
    for mod, path in known.items():
        mine = layer_of(mod)
        if mine is None:
            continue
        for target, line, _ in imports(path, known):
            theirs = layer_of(target)
            if theirs is not None and theirs[1] > mine[1]:
                upward.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} ({mine[0]}, layer {mine[1]}) -> {target} "
                    f"({theirs[0]}, layer {theirs[1]})"
                )
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def circles_of(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    known = modules()
    graph = {m: sorted({t for t, _, _ in imports(p, known)}) for m, p in known.items()}
    circles = circles_of(graph)
    assert not circles, "import circles between modules:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_circles_between_folders() -> None:
    known = modules()
    graph: dict[str, set[str]] = {}
    for mod, path in known.items():
        mine = layer_of(mod)
        if mine is None:
            continue
        for target, _, _ in imports(path, known):
            theirs = layer_of(target)
            if theirs is not None and theirs[0] != mine[0]:
                graph.setdefault(mine[0], set()).add(theirs[0])
    circles = circles_of({k: sorted(v) for k, v in graph.items()})
    assert not circles, "import circles between folders:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_config_imports_only_config() -> None:
    """config/ is the bottom: typed dataclasses and their parser (no torch, no algorithms, no models)."""
    known = modules()
    out = [
        f"{path.relative_to(PACKAGE.parent)}:{line} -> {target}"
        for mod, path in known.items()
        if mod.startswith("relayrl.config")
        for target, line, _ in imports(path, known)
        if not target.startswith("relayrl.config")
    ]
    assert not out, "config/ imports outside config/:\n" + "\n".join(out)


def test_relayrl_imports_are_at_the_top() -> None:
    known = modules()
    hidden = [
        f"{path.relative_to(PACKAGE.parent)}:{line} -> {target}"
        for mod, path in known.items()
        if mod not in IN_FUNCTION_ALLOWED
        for target, line, inside in imports(path, known)
        if inside
    ]
    assert not hidden, "relayrl imports inside functions (move them to the top):\n" + "\n".join(hidden)


def test_no_module_over_500_lines() -> None:
    long = [
        f"{p.relative_to(PACKAGE.parent)} ({n} lines)"
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := p.read_text().count("\n")) > MAX_LINES
    ]
    assert not long, "modules over 500 lines (split along a seam):\n" + "\n".join(long)


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """The reader above is not blind: an upward, in-function import in a synthetic module is found."""
    pkg = tmp_path / "relayrl"
    (pkg / "config").mkdir(parents=True)
    (pkg / "trainers").mkdir()
    for p in (pkg, pkg / "config", pkg / "trainers"):
        (p / "__init__.py").write_text("")
    (pkg / "trainers" / "sft.py").write_text("X = 1\n")
    bad = pkg / "config" / "base.py"
    bad.write_text("def f():\n    from relayrl.trainers.sft import X\n    return X\n")
    known = {module_name(p, tmp_path): p for p in pkg.rglob("*.py")}
    assert imports(bad, known, tmp_path) == [("relayrl.trainers.sft", 2, True)]
    assert circles_of({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert layer_of("relayrl.trainers.sft") == ("trainers", 7) and layer_of("relayrl.config.base") == (
        "config",
        1,
    )
