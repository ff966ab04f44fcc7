"""The product package imports only downward: every module of pdserve/ belongs to one layer;
it may import its own unit, any lower layer, and nothing of bench/ or tests/. Units of a layer
marked independent do not import each other. No import cycle between units."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdserve"

# Bottom first: (units, independent). A unit is a module prefix.
LAYERS: list[tuple[tuple[str, ...], bool]] = [
    (("pdserve.v1", "pdserve.kserve"), True),                       # generated stubs
    (("pdserve.common.env", "pdserve.common.config", "pdserve.common.context", "pdserve.common.hashing",
      "pdserve.common.outputs",
      "pdserve.common.security", "pdserve.common.telemetry", "pdserve.common.presets",
      "pdserve.common.default_model", "pdserve.common.detokenizer", "pdserve.common.sampling_params"), False),
    (("pdserve.common.ops",), True),
    (("pdserve.common.layers",), True),
    (("pdserve.common.models", "pdserve.common.loader"), False),
    (("pdserve.common.engine", "pdserve.common.kv_transfer"), True),
    (("pdserve.common.grpc_utils",), True),                         # the worker shell: wire side
    (("pdserve.common.serving",), True),                            # the worker shell: runtime
    (("pdserve.router", "pdserve.prefill_worker"), True),
    (("pdserve.decode_worker",), True),                             # role both also prefills
    (("pdserve.client", "pdserve.loadtest"), True),
    (("pdserve.cli",), True),
]
ROOTS = {"pdserve", "pdserve.common"}      # package __init__s: they import nothing of the layers


def _unit(module: str) -> tuple[int, str] | None:
    best = None
    for level, (units, _) in enumerate(LAYERS):
        for u in units:
            if (module == u or module.startswith(u + ".")) and (best is None or len(u) > len(best[1])):
                best = (level, u)
    return best


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, function-level ones included."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}")]
            out += [(node.lineno, m) for m in subs] or [(node.lineno, mod)]
    return out


def _product_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name)


def _edges() -> dict[tuple[str, str], list[str]]:
    """Import edges between units: (from unit, to unit) -> where."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in _product_files():
        src = _unit(_module_name(path))
        for line, mod in _imports(path):
            dst = _unit(mod)
            if src and dst and src[1] != dst[1]:
                edges.setdefault((src[1], dst[1]), []).append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return edges


def test_every_product_module_has_a_layer():
    missing = [str(p.relative_to(ROOT)) for p in _product_files()
               if _unit(_module_name(p)) is None and _module_name(p) not in ROOTS]
    assert not missing, f"modules outside every layer (add them to LAYERS): {missing}"


def test_no_upward_or_sideways_import():
    level = {u: i for i, (units, _) in enumerate(LAYERS) for u in units}
    independent = {u for units, ind in LAYERS if ind for u in units}
    bad = []
    for (src, dst), where in _edges().items():
        if level[dst] > level[src] or (level[dst] == level[src] and src in independent):
            bad += where
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_of_the_lab_or_the_tests():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in _product_files() for line, mod in _imports(p)
           if mod.split(".")[0] in ("bench", "tests")]
    assert not bad, "the product imports bench/ or tests/:\n" + "\n".join(bad)


def test_package_roots_import_no_layer():
    for name in ROOTS:
        path = ROOT.joinpath(*name.split(".")) / "__init__.py"
        assert not [m for _, m in _imports(path) if _unit(m)], f"{name}/__init__.py imports a layer"


def test_no_cycle_between_units():
    graph: dict[str, set[str]] = {}
    for src, dst in _edges():
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
