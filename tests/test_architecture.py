"""The package's layering holds, and no module's constants are assigned from outside it:
checked on the source (an ast scan), not by importing it.

Imports inside functions and under ``TYPE_CHECKING`` count as well: a lazy import is
still a dependency.
"""

import ast
import importlib.util
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlxserve"


def _module_file(name: str) -> Path | None:
    """The source of ``mlxserve.x.y`` (module or package), or None outside mlxserve."""
    parts = name.split(".")
    if parts[0] != "mlxserve":
        return None
    base = PACKAGE.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports (``from a import b``: ``a``, and ``a.b`` where that is
    an mlxserve module)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield module
            for alias in node.names:
                if _module_file(f"{module}.{alias.name}") is not None:
                    yield f"{module}.{alias.name}"


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _forbidden_reached(root: str, forbidden: tuple[str, ...]) -> list[str]:
    """``importer -> module`` for each module under ``forbidden`` that the files under
    ``root`` import, directly or through other mlxserve modules."""
    todo = sorted(PACKAGE.joinpath(*root.split(".")[1:]).rglob("*.py"))
    seen = set(todo)
    bad = set()
    while todo:
        path = todo.pop()
        for name in _imports(path):
            if _within(name, forbidden):
                bad.add(f"{_module_name(path)} -> {name}")
                continue
            source = _module_file(name)
            if source is not None and source not in seen:
                seen.add(source)
                todo.append(source)
    return sorted(bad)


def test_the_policy_is_pure() -> None:
    """``mlxserve.policy`` evaluates rules over a cluster into a plan: nothing it imports,
    directly or through other mlxserve modules, joins a group (any ``mlx``, so
    ``mlx.core.distributed`` too), moves bytes between ranks (``mlxserve.cluster``),
    loads a model (``mlxserve.models``) or orchestrates startup (``mlxserve.startup``)."""
    forbidden = ("mlx", "mlxserve.cluster", "mlxserve.models", "mlxserve.startup")
    bad = _forbidden_reached("mlxserve.policy", forbidden)
    assert not bad, "; ".join(bad)


def test_the_policy_reads_files_only_in_its_loaders() -> None:
    """Evaluating reads no file: only the rule-file loader and the calibration store touch
    the disk, and ``mlxserve.startup.plan`` calls them, never the evaluation."""
    loaders = {"rules.py", "calibration_store.py"}
    disk = ("os", "pathlib", "tempfile", "tomllib", "shutil", "io")
    bad = []
    for path in sorted((PACKAGE / "policy").glob("*.py")):
        if path.name in loaders:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bad += [f"{path.name} imports {n}" for n in _imports(path) if _within(n, disk)]
        bad += [
            f"{path.name}:{node.lineno} calls open()"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "open"
        ]
    assert not bad, "; ".join(bad)


def test_the_cluster_and_the_loader_know_no_policy() -> None:
    """``mlxserve.cluster`` only moves bytes and ``mlxserve.models`` only loads models: the
    plan's meaning (``mlxserve.policy``) and its building (``mlxserve.startup``) are
    their callers' business."""
    forbidden = ("mlxserve.policy", "mlxserve.startup")
    bad = {
        f"{_module_name(path)} imports {name}"
        for root in ("cluster", "models")
        for path in (PACKAGE / root).rglob("*.py")
        for name in _imports(path)
        if _within(name, forbidden)
    }
    assert not bad, "; ".join(sorted(bad))


# -- module globals -------------------------------------------------------------------

ROOT = PACKAGE.parent
#: where code that could assign another module's globals lives
SCANNED = ("mlxserve", "benchmarks", "tests", "training")
#: a constant's or a knob's name
UPPER = re.compile(r"_*[A-Z][A-Z0-9_]*")


def _is_module(name: str) -> bool:
    """Whether ``a.b.c`` names a module, found from the source tree and the installed
    packages' folders (nothing is imported)."""
    parts = name.split(".")
    # The benchmarks import their siblings by bare name (`from batch_step import ...`).
    bases = [ROOT, ROOT / "benchmarks"]
    if parts[0] not in SCANNED:
        try:
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            spec = None
        if spec is not None and len(parts) == 1:
            return True
        locations = spec.submodule_search_locations if spec is not None else None
        bases = [Path(location) for location in locations or []]
        parts = parts[1:]
    for base in bases:
        path = base.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
        if any(path.parent.glob(f"{path.name}.*.so")):
            return True
    return False


def _module_names(tree: ast.Module, package: list[str]) -> dict[str, str]:
    """The local names a file binds to modules (``import a.b as m``, ``from a import b``)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for alias in node.names:
                if _is_module(f"{module}.{alias.name}"):
                    names[alias.asname or alias.name] = f"{module}.{alias.name}"
    return names


def _dotted(node: ast.expr, modules: dict[str, str]) -> str | None:
    """The module an expression names (``m``, ``a.b``), or None."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _dotted(node.value, modules)
        if parent is not None and _is_module(f"{parent}.{node.attr}"):
            return f"{parent}.{node.attr}"
    return None


def _string(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """What an assignment assigns to, tuples unpacked."""
    todo: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        todo = [node.target]
    while todo:
        target = todo.pop()
        if isinstance(target, ast.Tuple | ast.List):
            todo += target.elts
        elif isinstance(target, ast.Starred):
            todo.append(target.value)
        else:
            yield target


def _setattr_target(call: ast.Call, modules: dict[str, str]) -> str | None:
    """``setattr(m, "X", v)``, ``monkeypatch.setattr(m, "X", v)``, ``patch.object(m, "X")``,
    ``monkeypatch.setattr("a.b.X", v)``, ``patch("a.b.X")``: the global they set, or None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name not in ("setattr", "object", "patch") or not call.args:
        return None
    path = _string(call.args[0])
    if path is not None:
        module = path.rpartition(".")[0]
        return path if name != "object" and module and _is_module(module) else None
    if len(call.args) >= 2 and name != "patch":
        module, attribute = _dotted(call.args[0], modules), _string(call.args[1])
        return f"{module}.{attribute}" if module and attribute else None
    return None


def _outside_assignments(source: str, module: str) -> list[str]:
    """``line: module.NAME`` for each UPPER_CASE global of another module that ``source``
    (the module ``module``) assigns or patches."""
    tree = ast.parse(source)
    package = module.split(".")[:-1]
    modules = _module_names(tree, package)
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        for target in _targets(node):
            if isinstance(target, ast.Attribute):
                owner = _dotted(target.value, modules)
                if owner is not None:
                    names.append(f"{owner}.{target.attr}")
        if isinstance(node, ast.Call):
            patched = _setattr_target(node, modules)
            names += [patched] if patched else []
        for name in names:
            owner, attribute = name.rsplit(".", 1)
            if UPPER.fullmatch(attribute) and owner != module:
                found.append(f"{getattr(node, 'lineno', 0)}: {name}")
    return found


def test_the_global_scan_finds_every_form() -> None:
    source = """
import mlxserve.engine.spec.mtp
from mlxserve.engine.runner import ring_cache as ring
from mlxserve.kernels import attention
from unittest import mock

attention.SPLIT = True
mlxserve.engine.spec.mtp.DEPTH += 1
first, (ring.RESERVE, *rest) = 1, (2, 3)
ring.RESERVE: int = 4
setattr(attention, "LIMIT", 2)
monkeypatch.setattr(ring, "RESERVE", 64)
monkeypatch.setattr("mlxserve.kernels.attention.LIMIT", 3)
mock.patch.object(attention, "LIMIT", 4)
mock.patch("mlxserve.kernels.attention.LIMIT", 5)
attention.helper = None
monkeypatch.setattr(attention, "_compiled", None)
settings.MODEL = "demo"
"""
    found = [line.split(": ")[1] for line in _outside_assignments(source, "tests.example")]
    assert sorted(found) == sorted(
        [
            "mlxserve.kernels.attention.SPLIT",
            "mlxserve.engine.spec.mtp.DEPTH",
            "mlxserve.engine.runner.ring_cache.RESERVE",
            "mlxserve.engine.runner.ring_cache.RESERVE",
            "mlxserve.kernels.attention.LIMIT",
            "mlxserve.engine.runner.ring_cache.RESERVE",
            "mlxserve.kernels.attention.LIMIT",
            "mlxserve.kernels.attention.LIMIT",
            "mlxserve.kernels.attention.LIMIT",
        ]
    )


def test_no_module_global_is_assigned_outside_its_module() -> None:
    """A module's constants and knobs change only in that module: a benchmark or a test
    sets a knob through the engine's tuning (``mlxserve.hardware.tuning``), so what
    runs never depends on who assigned a global last."""
    bad = []
    for root in SCANNED:
        for path in sorted((ROOT / root).rglob("*.py")):
            relative = path.relative_to(ROOT)
            parts = relative.with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            source = path.read_text(encoding="utf-8")
            bad += [f"{relative}:{hit}" for hit in _outside_assignments(source, module)]
    assert not bad, "module globals assigned outside their module: " + "; ".join(bad)


# -- packages: no import circle; the front and the channel apart from the engine ----------


def _top(name: str) -> str | None:
    """The top-level part of mlxserve (a subpackage or a module) ``name`` is in."""
    parts = name.split(".")
    return parts[1] if parts[0] == "mlxserve" and len(parts) > 1 else None


def _package_imports() -> dict[str, dict[str, str]]:
    """For each top-level part of mlxserve, the others it imports, each with the first
    ``importer -> imported`` that shows it."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        source = _top(module)
        if source is None:
            continue
        edges = graph.setdefault(source, {})
        for name in _imports(path):
            target = _top(name)
            if target is not None and target != source:
                edges.setdefault(target, f"{module} -> {name}")
    return graph


def _circle(graph: dict[str, dict[str, str]], start: str) -> list[str]:
    """The shortest chain of imports from ``start`` back to itself (empty: none)."""
    came_from: dict[str, str] = {}
    todo = deque([start])
    while todo:
        node = todo.popleft()
        for after in sorted(graph.get(node, {})):
            if after == start:
                chain = [graph[node][start]]
                while node != start:
                    chain.append(graph[came_from[node]][node])
                    node = came_from[node]
                return chain[::-1]
            if after not in came_from:
                came_from[after] = node
                todo.append(after)
    return []


def test_no_import_circle_between_packages() -> None:
    """The top-level parts of mlxserve import each other one way only, so each can be
    read (and tested) with what it imports and nothing that imports it."""
    graph = _package_imports()
    assert {"channel", "grammars"} <= set(graph["engine"]) and "channel" in graph["server"]
    circles = [" ; ".join(chain) for part in sorted(graph) if (chain := _circle(graph, part))]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_front_and_the_channel_never_import_the_engine() -> None:
    """The front (``mlxserve.server``) and the records it shares with the engine
    (``mlxserve.channel``) reach nothing of ``mlxserve.engine``, directly or through
    other modules: the engine runs in processes of its own, which the front outlives,
    and the channel's records are all they share."""
    for root in ("mlxserve.server", "mlxserve.channel"):
        bad = _forbidden_reached(root, ("mlxserve.engine",))
        assert not bad, "; ".join(bad)


def test_the_chat_formats_import_no_other_part() -> None:
    """``mlxserve.chat`` (templates, DeepSeek-V4's encoder, DSML, tool-call parsers) imports
    nothing else of mlxserve: the server hands it a `ChatRequest` and a tokenizer, and
    turns its refusals into 400s."""
    edges = _package_imports()["chat"]
    assert not edges, "; ".join(edges.values())
