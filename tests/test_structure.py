"""The shape of the code: imports point one way, at module level, and every cache fddp keeps is one
``fddp.clear_caches()`` clears.

The import graph is read from the sources (``ast``), so a cycle hidden by a function-level import
cannot pass: function-level imports of fddp are refused outright. The layers, bottom up:

    _caches -> _tree, _pool, _dist, runtime -> _layout -> sync -> optim -> zero -> checkpoint

with ``optim`` below ``sync`` in what it may use (layout and pool only: it never imports sync),
and the modules at the top (``fddp.module``, ``batchnorm``, ``join``, ``nonfinite``, ``scaling``)
importing whatever they need below them.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import torch

import fddp
import fddp._caches
import fddp._dist
import fddp._layout
import fddp._pool
import fddp.sync._setup

ROOT = Path(fddp.__file__).resolve().parent

# Each module's layer; a module may import only from layers at or below its own (sync and optim:
# optim never imports sync, sync never imports optim).
LAYERS = {
    "fddp._caches": 0,
    "fddp._errors": 0,
    "fddp._tree": 1,
    "fddp._pool": 1,
    "fddp._dist": 1,
    "fddp.runtime": 1,
    "fddp._layout": 2,
    "fddp.sync": 3,
    "fddp.optim": 3,
    "fddp.zero": 4,
    "fddp.checkpoint": 5,
    "fddp.module": 6,
    "fddp.batchnorm": 6,
    "fddp.join": 6,
    "fddp.nonfinite": 6,
    "fddp.scaling": 6,
    "fddp.diloco": 6,
    "fddp.ft": 7,  # optional (torchft): never imported by fddp's own __init__
    "fddp": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, module: str, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The fddp modules ``path`` imports at module level, and any it imports inside functions."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top, nested = set(), []

    def names(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            return [f"{base}.{a.name}" for a in node.names]  # a submodule, or a name in module `base`
        return []

    for node in ast.walk(tree):
        found = [n for n in names(node) if n.split(".")[0] == "fddp"]
        if not found:
            continue
        resolved = {r for r in (_resolve(n, modules) for n in found) if r and r != module}
        if node in tree.body or any(node in getattr(b, "body", []) for b in tree.body if isinstance(b, ast.If)):
            top |= resolved
        else:
            nested.append(f"{module}:{node.lineno}")
    return top, nested


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph, nested = {}, []
    for module, path in modules.items():
        graph[module], inner = _imports(path, module, modules)
        nested += inner
    assert not nested, f"fddp imported inside functions (hiding the import graph): {nested}"
    return graph


def _layer(module: str) -> int:
    return LAYERS[_resolve(module, {k: Path() for k in LAYERS})]  # type: ignore[index]


def test_imports_are_at_module_level_and_point_down():
    graph = _graph()
    wrong = []
    for module, deps in graph.items():
        if module.endswith("__init__") or module in ("fddp",):
            continue
        for dep in deps:
            is_package_init = _modules()[dep].name == "__init__.py" and dep != "fddp"
            if is_package_init and module.startswith(dep + "."):
                wrong.append(f"{module} imports its own package's __init__")
            if _layer(dep) > _layer(module):
                wrong.append(f"{module} (layer {_layer(module)}) imports {dep} (layer {_layer(dep)})")
            if module.startswith("fddp.optim") and dep.startswith("fddp.sync"):
                wrong.append(f"{module} imports {dep}: fddp.optim depends on the layout and the pool only")
            if module.startswith("fddp.sync") and dep.startswith("fddp.optim"):
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d == "fddp":
                continue
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Bottom-up, each module in a fresh interpreter of its own would be slow; one interpreter that
    imports each by name, in layer order, shows that none needs another to have been imported first
    beyond what it imports itself (a missing import is an error, not luck)."""
    order = sorted(_modules(), key=lambda m: (_layer(m), m))
    if importlib.util.find_spec("torchft") is None:  # fddp.ft needs the optional torchft (pip install "fddp[ft]")
        order = [m for m in order if not m.startswith("fddp.ft")]
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", script, *order], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# Every cache fddp keeps, by the name it is registered under. A new cache joins the registry
# (fddp._caches.cached or register) and this list; a forgotten one fails the scan below.
CACHES = {
    "fddp._tree.paths",
    "fddp._tree._dict_spec",
    "fddp._tree._flat_dict_order",
    "fddp._dist._states",
    "fddp._dist._name_digest",
    "fddp._pool._host_buffers",
    "fddp._layout._plan",
    "fddp._layout._view_args",
    "fddp._layout._inverse",
    "fddp._layout._laid",
    "fddp._layout._has_split",
    "fddp.sync._reducer._flat_leaves",
    "fddp.sync._reducer._where",
    "fddp.sync._reducer._nbytes",
    "fddp.sync._lax._plans",
    "fddp.sync._setup._plans",
    "fddp._dist._agreement._digests",
    "fddp._dist._agreement._owing",
    "fddp.sync._setup._options",
    "fddp.sync._setup._records",
    "fddp.zero._layout.layout",
    "fddp.zero._layout.leaf_pieces",
    "fddp.checkpoint._temp._host_id",
    "fddp.optim._kernels._kernel_items",
    "fddp.optim._slices._meta_leaves",
    "fddp.optim._slices._runs",
    "fddp.optim._muon_shards.plan",
    "fddp.scaling._alone",
    "fddp.diloco._outer._split_of",
    "fddp.diloco._outer._started",
    "fddp.diloco._checks._last_snapshot",
    "fddp.diloco._compress._e3m0_midpoints",
    "fddp.diloco._compress._e3m0_values",
}


def test_every_cache_is_registered_and_clear_caches_empties_it():
    assert set(fddp._caches.registered()) == CACHES
    # Nothing memoised escapes the registry: no functools cache in fddp's sources but _caches' own.
    for module, path in _modules().items():
        if module != "fddp._caches":
            text = path.read_text()
            # (functools.cached_property is per object, not a process-wide cache: allowed)
            assert "lru_cache" not in text and not re.search(r"functools\.cache\b(?!d)", text), f"{module} keeps a cache of its own"
    fddp.init()
    params = {"b": torch.ones(3), "a": torch.zeros(2)}
    opt = fddp.optim.adamw(1e-3)
    state = opt.init(params)
    grads, _ = fddp.grad_and_value(lambda p: sum((v * v).sum() for v in p.values()))(params)
    params, state = fddp.optim.apply_gradients(opt, grads, state, params)
    shards = fddp.zero.shard(params)
    fddp.zero.gather(shards).wait()
    fddp.clear_caches()
    memoised = [fddp._tree.paths, fddp._tree._dict_spec, fddp._layout._plan_cached, fddp.sync._reducer._where, fddp.zero._layout.layout]
    assert all(f.cache_info().currsize == 0 for f in memoised)
    assert not fddp.sync._setup._records and not fddp._layout._laid and not fddp._dist._agreement._digests
    assert not fddp.sync._setup._plans
    assert not fddp._dist._groups._states and not fddp._pool._host_buffers.free
