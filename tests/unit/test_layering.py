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
      "pdserve.common.outputs", "pdserve.common.worker_types",
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


# The router's protobuf edge: only these modules read or build wire messages (pdserve.v1,
# pdserve.kserve, grpc_health); the flow, the attempt, the registry and the output side work on
# domain types (pdserve.common.outputs, pdserve.common.worker_types), converted by
# pdserve.common.grpc_utils.convert.
ROUTER_PB2_EDGE = {
    "pdserve.router.worker_client",          # the workers' rpcs
    "pdserve.router.prefill_call",           # ... the Prefill rpc's request and stream
    "pdserve.router.servicer",               # Generation, InfoService
    "pdserve.router.validation",             # the door's check of the wire SamplingParams
    "pdserve.router.kserve.servicer", "pdserve.router.kserve.convert", "pdserve.router.kserve.tensors",
    "pdserve.router.openai_api.requests",    # OpenAI JSON -> GenerateRequest
}


def _pb2_imports(source: str, where: str) -> list[str]:
    """Every import of a generated module (``*_pb2``, ``*_pb2_grpc``) in ``source``, nested ones included."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                                                     else [])
            hits += [f"{where}:{node.lineno} imports {n}" for n in names if "_pb2" in n.rpartition(".")[2]]
    return hits


def test_router_protobuf_stops_at_its_edge():
    router = sorted((PACKAGE / "router").rglob("*.py"))
    assert {_module_name(p) for p in router} >= ROUTER_PB2_EDGE, "an edge module was renamed: update the list"
    bad = [hit for p in router if _module_name(p) not in ROUTER_PB2_EDGE
           for hit in _pb2_imports(p.read_text(), str(p.relative_to(ROOT)))]
    assert not bad, "protobuf inside the router (convert at the edge instead):\n" + "\n".join(bad)


def test_the_protobuf_check_sees_every_import_form():
    source = ("from pdserve.v1 import worker_pb2\nimport pdserve.v1.common_pb2\n"
              "from pdserve.kserve.grpc_predict_v2_pb2 import ModelInferRequest\n"
              "def f():\n    from grpc_health.v1 import health_pb2 as h\n"
              "from pdserve.common.grpc_utils import convert\n")
    assert len(_pb2_imports(source, "probe")) == 4


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
