"""The product package imports only downward: every module of pdserve/ belongs to one layer;
it may import its own unit, any lower layer, and nothing of bench/ or tests/. Units of a layer
marked independent do not import each other. No import cycle between units, nor between modules
(every import counts: module-level, function-level and type-only). The router never imports the
engine side (engine, models, layers, ops), directly or through another module. No product file
is longer than ``MAX_LINES``."""
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
    (("pdserve.common.guided",), True),                             # grammars (xgrammar) for guided decoding
    (("pdserve.common.parallel",), True),                           # tensor parallelism: rank group, sharded layers
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
    "pdserve.router.worker_health",          # ... their health service
    "pdserve.router.prefill_call",           # ... the Prefill rpc's request and stream
    "pdserve.router.servicer",               # Generation, InfoService
    "pdserve.router.validation",             # the door's check of the wire SamplingParams
    "pdserve.router.kserve.servicer", "pdserve.router.kserve.convert", "pdserve.router.kserve.tensors",
    "pdserve.router.openai_api.requests",    # OpenAI JSON -> GenerateRequest
    "pdserve.router.openai_api.slo_headers", # ... and its x-slo-* headers into GenerateRequest.slo
    "pdserve.router.openai_api.structured",  # ... response_format / guided_* into SamplingParams.guide
    "pdserve.router.openai_api.tools",       # ... tools and tool_choice into a guide
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


# ---- modules: no circles, the router apart from the engine, short files ----------------------

def _module_graph() -> dict[str, dict[str, list[str]]]:
    """Import edges between product modules: module -> imported module -> where (``path:line``)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in _product_files():
        me = _module_name(path)
        for line, mod in _imports(path):
            while mod and not _is_module(mod):      # ``from m import name``: the module m
                mod = mod.rpartition(".")[0]
            if mod.startswith("pdserve") and mod != me:
                graph.setdefault(me, {}).setdefault(mod, []).append(f"{path.relative_to(ROOT)}:{line}")
    return graph


def _reaches(graph: dict[str, dict[str, list[str]]], *starts: str) -> dict[str, str | None]:
    """Every module ``starts`` import, directly or not: module -> the module that imports it
    (None for a start)."""
    parent: dict[str, str | None] = dict.fromkeys(starts)
    todo = list(starts)
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, {}):
            if nxt not in parent:
                parent[nxt] = node
                todo.append(nxt)
    return parent


def _without(graph: dict[str, dict[str, list[str]]], edges) -> dict[str, dict[str, list[str]]]:
    return {a: {b: w for b, w in dst.items() if (a, b) not in edges} for a, dst in graph.items()}


def _circles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# Import edges that close a circle today, each to be removed (issue 40); an entry that no longer
# closes one fails the test, so the list only shrinks. router/admission.py imports (for types)
# the modules that import it for AdmissionConfig (settings) and REASONS (metrics): moving those
# two out of admission.py into a module of their own breaks all four.
KNOWN_CIRCLE_EDGES = {
    ("pdserve.router.admission", "pdserve.router.settings"),
    ("pdserve.router.admission", "pdserve.router.metrics"),
    ("pdserve.router.admission", "pdserve.router.worker_client"),
    ("pdserve.router.admission", "pdserve.router.workers"),
}


def test_no_import_circle_between_modules():
    graph = _module_graph()
    stale = [f"{a} -> {b}" for a, b in sorted(KNOWN_CIRCLE_EDGES) if b not in graph.get(a, {})
             or a not in _reaches(graph, b)]
    assert not stale, "no longer an edge of a circle (remove from KNOWN_CIRCLE_EDGES):\n" + "\n".join(stale)
    rest = _without(graph, KNOWN_CIRCLE_EDGES)
    bad = [f"{a} -> {b} ({', '.join(rest[a][b])})" for comp in _circles(rest) for a in comp for b in comp
           if b in rest.get(a, {})]
    assert not bad, "modules that import each other (move the shared piece down instead):\n" + "\n".join(bad)


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b": ["a.py:1"]}, "b": {"c": ["b.py:1"]}, "c": {"a": ["c.py:1"]}, "d": {"a": ["d.py:1"]}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles(_without(graph, {("c", "a")})) == []


ENGINE_SIDE = ("pdserve.common.engine", "pdserve.common.models", "pdserve.common.layers", "pdserve.common.ops")
# Router -> engine edges pending (issue 40); the list only shrinks.
KNOWN_ROUTER_ENGINE_EDGES: set[tuple[str, str]] = set()


def test_router_never_imports_the_engine():
    graph = _module_graph()
    stale = [f"{a} -> {b}" for a, b in sorted(KNOWN_ROUTER_ENGINE_EDGES) if b not in graph.get(a, {})]
    assert not stale, "no longer imported (remove from KNOWN_ROUTER_ENGINE_EDGES):\n" + "\n".join(stale)
    rest = _without(graph, KNOWN_ROUTER_ENGINE_EDGES)
    parent = _reaches(rest, *sorted(m for m in rest if m.startswith("pdserve.router")))
    bad = []
    for mod in sorted(m for m in parent if not m.startswith(ENGINE_SIDE)):
        for dst, where in sorted(rest.get(mod, {}).items()):
            if dst.startswith(ENGINE_SIDE):
                chain = [mod]
                while (up := parent[chain[-1]]) is not None:
                    chain.append(up)
                bad.append(f"{dst} <- {' <- '.join(chain)} ({', '.join(where)})")
    assert not bad, "the router reaches the engine side:\n" + "\n".join(bad)


MAX_LINES = 400


def test_product_files_are_short():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _product_files()}
    long = sorted(f"{f}: {n} lines" for f, n in lines.items() if n > MAX_LINES)
    assert not long, f"product files over {MAX_LINES} lines (split along a seam):\n" + "\n".join(long)
