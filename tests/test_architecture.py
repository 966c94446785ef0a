"""The import rule of docs/ARCHITECTURE.md, checked: every module has a layer, imports never go up, no circles.

The layers are read from ARCHITECTURE.md's table, so the document and the
check cannot drift apart; the imports are read from the source with ``ast``
(``import x`` and ``from x import y``, lazy ones inside functions included).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specdec_cli"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (packages by their ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.with_suffix("").relative_to(ROOT).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for candidate in [target, *(f"{target}.{a.name}" for a in node.names)]:
                if candidate in known:
                    found.add(candidate)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    found.discard(name)
    return found


def layers() -> dict[str, int]:
    """Module (or package, ending in ``.*``) -> layer number, from the document's table."""
    table = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|[^|]*\|([^|]*)\|", line)
        if m:
            for entry in re.findall(r"`([^`]+)`", m.group(2)):
                table[entry] = int(m.group(1))
    assert table, "docs/ARCHITECTURE.md has no layer table"
    return table


def layer_of(name: str, table: dict[str, int]) -> int:
    short = name.removeprefix("specdec_cli.")
    if short in table:
        return table[short]
    package = short.split(".")[0] + ".*"
    if package in table:
        return table[package]
    raise AssertionError(f"{name} has no layer in docs/ARCHITECTURE.md: put it in the table")


def test_every_module_has_a_layer_and_every_entry_a_module():
    known, table = modules(), layers()
    for name in known:
        if name != "specdec_cli":
            layer_of(name, table)
    shorts = {n.removeprefix("specdec_cli.") for n in known}
    packages = {s.split(".")[0] + ".*" for s in shorts if "." in s}
    stale = [entry for entry in table if entry not in shorts | packages]
    assert not stale, f"docs/ARCHITECTURE.md names modules that do not exist: {stale}"


def test_imports_never_go_up_a_layer():
    known, table = modules(), layers()
    upward = []
    for name, path in known.items():
        if name == "specdec_cli":
            continue
        for target in imports(name, path, known):
            if target == "specdec_cli":  # the package's face: its version string
                continue
            if layer_of(target, table) > layer_of(name, table):
                upward.append(f"{name} (layer {layer_of(name, table)}) imports {target} "
                              f"(layer {layer_of(target, table)})")
    assert not upward, "imports up the layers:\n" + "\n".join(sorted(upward))


def circle(graph: dict[str, set[str]]) -> list[str]:
    """An import circle in ``graph`` (the nodes round it, the first repeated at the end), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return []


def package_of(name: str) -> str:
    """The package a module belongs to (``cli`` for ``specdec_cli.cli.app``); a root module is its own."""
    return name.removeprefix("specdec_cli.").split(".")[0]


def test_no_import_circles():
    known = modules()
    graph = {name: imports(name, path, known) - {"specdec_cli"} for name, path in known.items()}
    assert not circle(graph), "an import circle: " + " -> ".join(circle(graph))


def test_no_circles_between_packages():
    # The picture's arrows: one package imports another only if that one never imports it back.
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        if name == "specdec_cli":
            continue
        graph.setdefault(package_of(name), set()).update(
            package_of(t) for t in imports(name, path, known) - {"specdec_cli"} if package_of(t) != package_of(name))
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    assert not circle(graph), "packages import each other: " + " -> ".join(circle(graph))
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # it finds one where there is one


def test_a_handful_of_modules_at_the_root():
    root = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert root == ["__init__", "__main__", "defaults", "errors"], root


def test_the_check_sees_an_upward_import(tmp_path):
    # The rule can fail: a module of the lowest layer importing one of the faces is found.
    fake = {"specdec_cli.errors": tmp_path / "errors.py", "specdec_cli.cli.app": tmp_path / "cli.py"}
    fake["specdec_cli.errors"].write_text("from .cli import app\n")
    fake["specdec_cli.cli.app"].write_text("")
    table = layers()
    found = imports("specdec_cli.errors", fake["specdec_cli.errors"], fake)
    assert found == {"specdec_cli.cli.app"}
    assert layer_of("specdec_cli.cli.app", table) > layer_of("specdec_cli.errors", table)
