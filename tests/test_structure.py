"""The package's structure holds: imports point one way, no private names cross modules,
nodes do not probe each other, and a torchdata node that shuts the graph down stops it."""

import ast
import functools
import threading
import time
from pathlib import Path

import pytest
from stores import Var, write_store
from torchdata.nodes import BaseNode, Loader, Prefetcher

import insitubatch_nodes as ib

PKG = Path(ib.__file__).parent


@functools.cache  # parsed once per test process (only read: every test walks the same trees)
def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _resolve(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Every package module -> the package modules it imports (at any depth of the file,
    function-level imports included: a cycle hidden in a function is still a cycle)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, tree in mods.items():
        is_pkg = (PKG.parent / Path(*name.split(".")) / "__init__.py").exists()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node, is_pkg)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("insitubatch_nodes"):
                    graph[name].add(t)
    return graph


def _is_type_checking(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                lines.add(getattr(sub, "lineno", -1))
    return lines


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    graph = _imports(_modules())
    # A package's __init__ re-exports its children: an edge from a child to its own package
    # is the child importing a sibling through the package, not a cycle through it.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# What may import what, bottom to top (DESIGN.md "Layers"): a module may import its own
# layer and the layers below, never one above. An entry names a sub-package or one module
# of it ("state.checkpoint"); a module's layer is that of its most specific entry.
LAYERS = [
    {"errors", "sampling", "memory", "metrics", "state.fingerprint", "state.problems",
     "state.ranks"},
    {"io", "workers", "store"},
    {"config", "defaults"},
    {"fetch"},
    {"nodes"},
    {"graph", "graph_stages", "graph_stats", "state"},
    {"loader", "dataset", "inspection", "synthetic", "demo", "testing"},
    {"cli", "bench", ""},
]


def _layer(module: str) -> int:
    parts = module.split(".")[1:]
    for n in range(len(parts), 0 if parts else -1, -1):  # "" is the package's __init__ alone
        name = ".".join(parts[:n])
        for i, layer in enumerate(LAYERS):
            if name in layer:
                return i
    raise AssertionError(f"module {module} is in no layer of this test: add it to LAYERS "
                         "(and to DESIGN.md)")


def test_imports_point_one_way():
    graph = _imports(_modules())
    bad = []
    for m, targets in graph.items():
        for t in targets:
            if m.startswith(t + "."):
                continue  # a child importing its package's __init__ (re-exports)
            if _layer(t) > _layer(m):
                bad.append(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})")
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_name():
    bad = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or
                                                     (node.module or "").startswith(
                                                         "insitubatch_nodes")):
                bad += [f"{name}: from {'.' * node.level}{node.module} import {a.name}"
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_nodes_do_not_probe_each_other_with_hasattr():
    bad = []
    for name, tree in _modules().items():
        if not name.startswith("insitubatch_nodes.nodes"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "hasattr":
                bad.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def _fetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("insitubatch-fetch")]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("structure") / "s.zarr"
    write_store(path, [Var("x", (96, 3), (8, 3))])
    src = ib.open_source(path)
    return src, ib.split_by_chunk(src, (1.0,))


class _ShutsDownItsSource(BaseNode):
    """torchdata's main branch: ``shutdown()`` on a node calls ``source.shutdown()``
    (0.11, pinned here, lacks it), so this is what a newer Prefetcher/Loader does."""

    def __init__(self, source: BaseNode) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self):
        return next(self.source)

    def get_state(self):
        return self.source.state_dict()

    def shutdown(self) -> None:
        self.source.shutdown()


def test_a_torchdata_prefetcher_over_the_graph_is_shut_down_through_it(small):
    src, m = small
    before = set(_fetch_threads())
    loader = ib.build_loader(src, m, "train", batch_size=4, block_chunks=2)
    # A torchdata Prefetcher between our graph and a node that shuts its source down.
    outer = _ShutsDownItsSource(Prefetcher(loader.root, prefetch_factor=2))
    # Prefetcher (0.11) has no shutdown(); the torchdata convention on main is that it
    # passes it to its source: emulate that one method, nothing else.
    outer.source.shutdown = lambda: (outer.source._it._shutdown(),  # its own thread
                                     loader.root.shutdown())
    it = iter(Loader(outer))
    for _ in range(3):
        next(it)
    mine = [t for t in _fetch_threads() if t not in before]
    assert mine and all(t.is_alive() for t in mine)
    outer.shutdown()
    time.sleep(0.05)
    assert not any(t.is_alive() for t in mine)


def test_loader_shutdown_stops_the_fetch_thread_through_a_prefetcher(small):
    """InSituLoader over a graph with a torchdata Prefetcher inside: ``shutdown()`` (and
    ``close()``, ``with``) reaches the fetch thread through it."""
    src, m = small
    before = set(_fetch_threads())
    inner = ib.build_loader(src, m, "train", batch_size=4, block_chunks=2)
    loader = ib.InSituLoader(Prefetcher(inner.root, prefetch_factor=2))
    it = iter(loader)
    for _ in range(3):
        next(it)
    mine = [t for t in _fetch_threads() if t not in before]
    assert mine
    loader.shutdown()
    time.sleep(0.05)
    assert not any(t.is_alive() for t in mine)


def test_close_stops_the_thread_and_a_later_epoch_restarts_it_but_shutdown_is_final(small):
    src, m = small
    before = set(_fetch_threads())
    loader = ib.build_loader(src, m, "train", batch_size=4, block_chunks=2)
    with loader:
        first = [b["sample_index"].tolist() for b in loader]
        mine = [t for t in _fetch_threads() if t not in before]
    assert mine
    time.sleep(0.05)
    assert not any(t.is_alive() for t in mine)  # close() on exit stopped it
    again = [b["sample_index"].tolist() for b in loader]  # closed, not shut down: restarts
    assert sorted(sum(again, [])) == sorted(sum(first, []))
    loader.shutdown()
    with pytest.raises(RuntimeError, match="was shut down"):
        next(iter(loader))


# -- sizes that keep the house readable (torchdata's nodes/ is the model) ----------------
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_CLASS_ATTRIBUTES = 25
MAX_TOP_LEVEL_MODULES = 12
MAX_SUBPACKAGE_MODULES = 20


def _attributes(cls: ast.ClassDef) -> set[str]:
    """What a class's instances carry: ``self.x = ...`` anywhere in it and annotated
    class-level fields (a dataclass's)."""
    names = {st.target.id for st in cls.body
             if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"):
                    names.add(sub.attr)
    return names


def _definitions(tree: ast.AST, prefix: str):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield f"{prefix}.{node.name}", node
            yield from _definitions(node, f"{prefix}.{node.name}")


def test_modules_functions_and_classes_stay_small():
    bad = []
    for name, tree in _modules().items():
        path = PKG.parent / Path(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            bad.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES})")
        for qual, node in _definitions(tree, name):
            size = node.end_lineno - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                n = len(_attributes(node))
                if n > MAX_CLASS_ATTRIBUTES:
                    bad.append(f"{qual}: {n} attributes (at most {MAX_CLASS_ATTRIBUTES})")
            elif size > MAX_FUNCTION_LINES:
                bad.append(f"{qual}: {size} lines (at most {MAX_FUNCTION_LINES})")
    assert not bad, "\n".join(bad)


def test_the_size_checks_count_what_they_say():
    tree = ast.parse("class A:\n    x: int\n    def f(self):\n        self.y = 1\n"
                     "        self.z += 1\n        self.w: int = 2\n        q = self.v\n")
    assert _attributes(tree.body[0]) == {"x", "y", "z", "w"}
    assert [q for q, _ in _definitions(tree, "m")] == ["m.A", "m.A.f"]


def test_the_top_level_holds_few_modules_and_sub_packages_stay_small():
    per_package: dict[str, int] = {}
    for name in _modules():
        parts = name.split(".")
        # a package's __init__ is one of its own modules; a plain module, its parent's
        key = name if (PKG.parent / Path(*parts)).is_dir() else ".".join(parts[:-1])
        per_package[key] = per_package.get(key, 0) + 1
    top = per_package.pop("insitubatch_nodes")
    assert top <= MAX_TOP_LEVEL_MODULES, f"{top} modules at the top level"
    big = {k: n for k, n in per_package.items() if n > MAX_SUBPACKAGE_MODULES}
    assert not big, big
