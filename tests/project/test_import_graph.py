"""The import graph of ``aadet`` has floors and no cycles; the user's commands (``tools/*.py``,
``datasets/prepare_trees.py``) import the library and nothing else of the checkout; the project's
own machinery (``dev/``, its shared package ``dev/aadet_dev``) imports the library, never the
reverse. The package is what a user imports to build, train, evaluate, analyse, benchmark and
export models: it reads no archives and downloads nothing, and runs no program but ``git`` for a
run's provenance (``aadet.utils.collect_env``) and Python for a benchmark case in a fresh process
(``aadet.benchmark.timing``); importing it loads none of the commands' or dev's code.

Floors, lowest first (``/work/shared/STYLE.md``; Detectron2 has the same shape): a module never
imports one on a higher floor, not even inside a function. Same-floor imports are allowed where
they form no cycle, neither between modules nor between the packages of a floor.

    0  aadet.layers
    1  aadet.utils, aadet.config
    2  aadet.modeling, aadet.data, and ``aadet/__init__.py`` (it imports config and modeling)
    3  aadet.engine, aadet.export, aadet.analysis, aadet.benchmark
    4  aadet.analysis.model_stats (builds a config's model through the engine)
    5  tools/*.py, datasets/prepare_trees.py (the user's commands: aadet and third-party packages)
    6  dev/aadet_dev (the project's shared machinery: imports aadet, never a command)
    7  dev/*.py (import aadet and aadet_dev)

Every module is parsed with ``ast`` (nothing is imported): all ``import`` / ``from ... import``
statements, at any depth (functions, ``try``, ``if TYPE_CHECKING``), relative ones resolved.
``from package import name`` is an edge to ``package.name`` when that is a module, else to
``package``. The parent packages Python runs on the way to a module are not edges.
"""
import ast
import json
import os
import subprocess
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Set, Tuple

import pytest

from tests.helpers import REPO

PACKAGE = "aadet"
#: The dev machinery's shared package (``dev/aadet_dev``): not part of the installed aadet.
DEV_PACKAGE = "aadet_dev"

#: Floor of each package of aadet (a module's floor is its package's); a new top-level module or
#: package must be added here.
FLOORS: Dict[str, int] = {
    "aadet.layers": 0,
    "aadet.utils": 1,
    "aadet.config": 1,
    "aadet.modeling": 2,
    "aadet.data": 2,
    "aadet.engine": 3,
    "aadet.export": 3,
    "aadet.analysis": 3,
    "aadet.benchmark": 3,
    "aadet.analysis.model_stats": 4,
}
ROOT_FLOOR = 2  # aadet/__init__.py alone (not the modules under it)

Edge = Tuple[str, str, int]  # (importer, imported, line)


# ----------------------------------------------------------------------------- parsing
def module_files(root: str, package: str) -> Dict[str, str]:
    """``{dotted module name: file}`` of every ``.py`` file under ``root/package``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, root).split(os.sep)
        for f in sorted(filenames):
            if f.endswith(".py"):
                parts = rel + ([] if f == "__init__.py" else [f[:-3]])
                out[".".join(parts)] = os.path.join(dirpath, f)
    return out


def _resolve_relative(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]  # the package the importer lives in
    if level - 1 > len(base) - 1:
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(path: str, importer: str, is_package: bool) -> List[Tuple[str, int]]:
    """``(dotted name, line)`` of every import in a file; ``from a import b`` gives ``a.b``
    (the caller decides whether that is a module or a name in ``a``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(importer, is_package, node.level, node.module)
            else:
                base = node.module
            out += [(f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno)
                    for alias in node.names]
    return out


def _known(name: str, modules) -> Optional[str]:
    """The longest prefix of ``name`` that is one of ``modules`` (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def aadet_graph(root: str = REPO) -> Tuple[Dict[str, str], List[Edge]]:
    """``(modules, edges)``: aadet's modules and the imports between them."""
    modules = module_files(root, PACKAGE)
    edges = {}
    for name, path in modules.items():
        is_package = path.endswith("__init__.py")
        for target, line in imports_of(path, name, is_package):
            known = _known(target, modules)
            if known is not None and known != name:
                edges.setdefault((name, known, line))
    return modules, list(edges)


def floor_of(module: str) -> Tuple[str, int]:
    """``(package, floor)`` of an aadet module: its package in :data:`FLOORS`."""
    if module == PACKAGE:
        return PACKAGE, ROOT_FLOOR
    package = _known(module, FLOORS)
    if package is None:
        raise KeyError(f"{module} is on no floor: add its package to FLOORS in {__file__}")
    return package, FLOORS[package]


# ----------------------------------------------------------------------------- cycles
def find_cycles(edges: Sequence[Tuple[str, str]]) -> List[List[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component with a cycle (Tarjan)."""
    graph: Dict[str, Set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph[b]
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(v: str):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1 or v in graph[v]:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(comp[0], set(comp), graph) for comp in components]


def _cycle_through(start: str, comp: Set[str], graph) -> List[str]:
    """A shortest path ``start -> ... -> start`` inside one component (breadth first)."""
    parent = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]  # v, parent of v, ..., start
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in comp and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def _format_cycle(cycle: Sequence[str], lines: Dict[Tuple[str, str], int]) -> str:
    hops = [f"{a} (line {lines[a, b]})" if (a, b) in lines else a for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(hops + [cycle[-1]])


# ----------------------------------------------------------------------------- checks of aadet
@pytest.fixture(scope="module")
def graph():
    return aadet_graph()


def test_every_module_has_a_floor(graph):
    modules, _ = graph
    unplaced = [m for m in modules if m != PACKAGE and _known(m, FLOORS) is None]
    assert not unplaced, f"modules outside every floor (add their package to FLOORS): {unplaced}"


def test_no_module_imports_a_higher_floor(graph):
    modules, edges = graph
    bad = []
    for a, b, line in edges:
        (pa, fa), (pb, fb) = floor_of(a), floor_of(b)
        if fb > fa:
            bad.append(f"{modules[a]}:{line}: {a} (floor {fa}, {pa}) imports {b} (floor {fb}, {pb})")
    assert not bad, "imports from a higher floor:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules(graph):
    _, edges = graph
    lines = {(a, b): line for a, b, line in edges}
    cycles = find_cycles([(a, b) for a, b, _ in edges])
    assert not cycles, "import cycles:\n" + "\n".join(_format_cycle(c, lines) for c in cycles)


def test_no_import_cycle_between_packages(graph):
    """Between the packages of ``FLOORS`` (e.g. ``aadet.engine`` and ``aadet.analysis``): one may
    import the other, not both."""
    _, edges = graph
    pairs, where = [], {}
    for a, b, line in edges:
        pa, pb = floor_of(a)[0], floor_of(b)[0]
        if pa != pb:
            pairs.append((pa, pb))
            where.setdefault((pa, pb), f"{a} -> {b}, line {line}")
    cycles = find_cycles(pairs)
    assert not cycles, "import cycles between packages:\n" + "\n".join(
        " => ".join(f"{x} ({where[x, y]})" for x, y in zip(c, c[1:])) + f" => {c[-1]}" for c in cycles
    )


# ----------------------------------------------------------------------------- tools and dev
def script_files(folder: str, root: str = REPO) -> Dict[str, str]:
    """``{module name: file}`` of the Python scripts directly in ``root/folder``."""
    d = os.path.join(root, folder)
    return {f[:-3]: os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".py")}


def user_commands(root: str = REPO) -> Dict[str, str]:
    """``tools/*.py`` and ``datasets/prepare_trees.py``: what a user runs."""
    return {**script_files("tools", root), "prepare_trees": os.path.join(root, "datasets", "prepare_trees.py")}


def dev_package_files(root: str = REPO) -> Dict[str, str]:
    """``{dotted module name: file}`` of ``dev/aadet_dev``."""
    return module_files(os.path.join(root, "dev"), DEV_PACKAGE)


def _imports_of_any(files: Dict[str, str], names) -> List[str]:
    return [
        f"{path}:{line}: {name} imports {target}"
        for name, path in files.items()
        for target, line in imports_of(path, name, path.endswith("__init__.py"))
        if target.split(".")[0] in names
    ]


def test_user_commands_import_the_library_and_nothing_else_of_the_checkout():
    commands = user_commands()
    others = set(commands) | set(script_files("dev")) | {DEV_PACKAGE, "tests"}
    bad = _imports_of_any(commands, others)
    assert not bad, "a user's command imports another command or the project's machinery " \
        "(shared code belongs in aadet):\n" + "\n".join(bad)


def test_the_dev_package_imports_the_library_and_no_script():
    modules = dev_package_files()
    assert modules, f"no {DEV_PACKAGE} package under dev/"
    bad = _imports_of_any(modules, set(user_commands()) | set(script_files("dev")))
    assert not bad, f"{DEV_PACKAGE} imports a script (a script imports it, not the reverse):\n" + "\n".join(bad)


def test_dev_scripts_import_no_other_script():
    scripts = script_files("dev")
    bad = _imports_of_any(scripts, set(scripts) | set(user_commands()))
    assert not bad, "dev scripts import other scripts (move the shared code into dev/aadet_dev):\n" + "\n".join(bad)


def test_the_library_imports_no_command_and_no_dev_code(graph):
    modules, _ = graph
    bad = _imports_of_any(modules, set(user_commands()) | set(script_files("dev")) | {DEV_PACKAGE})
    assert not bad, "aadet imports code that is not part of the installed package:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the package's job
#: Modules whose use is the commands' work, not the package's: archives, downloads, other programs.
OPERATIONS_MODULES = ("zipfile", "tarfile", "gzip", "bz2", "lzma", "urllib.request", "http", "requests",
                      "pip", "subprocess")
#: The modules of aadet allowed one of them, and which: git for a run's provenance (as Detectron2's
#: collect_env runs git), and a benchmark case in a fresh Python process of its own.
OPERATIONS_ALLOWED = {"aadet.utils.collect_env": ("subprocess",), "aadet.benchmark.timing": ("subprocess",)}


def _is_operation(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in OPERATIONS_MODULES)


def test_the_library_reads_no_archives_and_runs_no_programs(graph):
    modules, _ = graph
    bad = [
        f"{path}:{line}: {name} imports {target}"
        for name, path in modules.items()
        for target, line in imports_of(path, name, path.endswith("__init__.py"))
        if _is_operation(target) and target.split(".")[0] not in OPERATIONS_ALLOWED.get(name, ())
    ]
    assert not bad, "aadet does a command's work (move it to tools/, datasets/ or dev/):\n" + "\n".join(bad)


def test_importing_the_library_loads_no_commands_code():
    """In a fresh interpreter, ``aadet`` and every package of it: no module from ``tools/``,
    ``datasets/`` or ``dev/`` is loaded, and all of aadet's come from this checkout."""
    packages = sorted(n for n, f in module_files(REPO, PACKAGE).items() if f.endswith("__init__.py"))
    code = (
        "import importlib, json, sys\n"
        f"for name in {packages!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps({n: getattr(m, '__file__', None) for n, m in list(sys.modules.items())}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stderr[-3000:]
    loaded = json.loads(p.stdout.strip().splitlines()[-1])
    ours = {n: f for n, f in loaded.items() if n == PACKAGE or n.startswith(PACKAGE + ".")}
    assert "aadet.engine" in ours and all(f is None or f.startswith(REPO) for f in ours.values()), ours
    folders = tuple(os.path.join(REPO, d) + os.sep for d in ("tools", "datasets", "dev"))
    outside = sorted(n for n, f in loaded.items() if f and f.startswith(folders))
    assert not outside, f"importing aadet loads code that is not the package's: {outside}"


def test_operation_check_sees_through_submodules():
    assert _is_operation("zipfile.ZipFile") and _is_operation("urllib.request.urlopen")
    assert not _is_operation("urllib.parse.urlparse") and not _is_operation("zipfilex")


# ----------------------------------------------------------------------------- the checker itself
def _write(root, files: Dict[str, str]):
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def test_checker_resolves_relative_and_nested_imports(tmp_path):
    _write(tmp_path, {
        "aadet/__init__.py": "from . import modeling\n",
        "aadet/config.py": "def f():\n    from .modeling.head import HEADS\n",
        "aadet/modeling/__init__.py": "from .head import HEADS\n",
        "aadet/modeling/head.py": "from ..config import f\nimport aadet.layers.conv as c\n",
        "aadet/layers/__init__.py": "",
        "aadet/layers/conv.py": "try:\n    from aadet import utils\nexcept ImportError:\n    pass\n",
        "aadet/utils/__init__.py": "",
    })
    _, edges = aadet_graph(str(tmp_path))
    got = {(a, b) for a, b, _ in edges}
    assert got == {
        ("aadet", "aadet.modeling"),
        ("aadet.config", "aadet.modeling.head"),  # inside a function, to a higher floor
        ("aadet.modeling", "aadet.modeling.head"),
        ("aadet.modeling.head", "aadet.config"),
        ("aadet.modeling.head", "aadet.layers.conv"),
        ("aadet.layers.conv", "aadet.utils"),  # inside try: layers -> utils, a higher floor
    }
    assert find_cycles([(a, b) for a, b, _ in edges]) == [
        ["aadet.config", "aadet.modeling.head", "aadet.config"]
    ]
    assert floor_of("aadet.layers.conv") == ("aadet.layers", 0)
    assert floor_of("aadet.modeling.head") == ("aadet.modeling", 2)
    assert floor_of("aadet") == ("aadet", ROOT_FLOOR)
    with pytest.raises(KeyError, match="add its package to FLOORS"):
        floor_of("aadet.newpackage.module")  # a new top-level package needs its floor


def test_cycle_report_is_a_closed_path():
    cycles = find_cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "d"), ("e", "a")])
    assert sorted(cycles) == [["a", "b", "c", "a"], ["d", "d"]]
