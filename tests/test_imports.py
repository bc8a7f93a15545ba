"""Imports flow downward and never in a circle: `mnemojax -> models -> shardings`, read from the source.

Every `import` of every module of the three packages counts, those inside functions too (a deferred import
hides a cycle, it does not remove it).
"""
import ast
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("mnemojax", "models", "shardings")
# What each package may import of the others: downward only.
ALLOWED = {"mnemojax": {"mnemojax", "models", "shardings"}, "models": {"models", "shardings"},
           "shardings": {"shardings"}}


def _modules() -> dict[str, str]:
    """{dotted module name: path} of every module of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the modules of PACKAGES it imports} (`from a import b` counts as importing a.b when that is a
    module, else a)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first walk meets (each as a path that ends where it starts); none means acyclic."""
    cycles, state, stack = [], {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        state[u] = "done"
        stack.pop()

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return cycles


def test_find_cycles_finds_them():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "models.pallas_attention" in graph["models.attention"]  # the walk sees real edges
    assert find_cycles(graph) == []


def test_imports_flow_downward():
    wrong = sorted((m, i) for m, imported in import_graph().items() for i in imported
                   if i.split(".")[0] not in ALLOWED[m.split(".")[0]])
    assert wrong == []


def test_pallas_kernels_import_alone():
    """In a fresh process, the kernels' module imports without the reference module it used to need."""
    code = ("import sys, models.pallas_attention; assert 'models.attention' not in sys.modules, 'imported'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# Inside mnemojax, one package per concern; what each may import (besides itself, models and shardings where
# listed). `mnemojax.cli` is the flag helper every command uses; `bench`, the package's `__init__` and the
# command shims (`serve`, `plan`) sit on top and may import anything.
LAYERS = {
    "mnemojax.cli": set(),
    "mnemojax.scheduling": {"models"},
    "mnemojax.engine": {"mnemojax.scheduling", "mnemojax.cli", "models", "shardings"},
    "mnemojax.serving": {"mnemojax.engine", "mnemojax.scheduling", "mnemojax.cli", "models"},  # models.tokenizer
    "mnemojax.sim": {"mnemojax.scheduling", "mnemojax.cli", "models"},
}


def _layer(module: str) -> str | None:
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def _allowed(module: str, imported: str) -> bool:
    layer = _layer(module)
    if layer is None:
        return True  # mnemojax/__init__, the command shims, bench, models, shardings (checked above)
    target = _layer(imported) or imported.split(".")[0]
    return target == layer or target in LAYERS[layer]


def test_packages_inside_mnemojax_are_layered():
    graph = import_graph()
    assert "mnemojax.scheduling.scheduler" in graph["mnemojax.engine.llm_engine"]  # real edges seen
    wrong = sorted((m, i) for m, imported in graph.items() for i in imported if not _allowed(m, i))
    assert wrong == []


def test_layer_check_catches_an_upward_import():
    assert not _allowed("mnemojax.scheduling.scheduler", "mnemojax.engine.executor")
    assert not _allowed("mnemojax.engine.executor", "mnemojax.serving.app")
    assert not _allowed("mnemojax.sim.simulator", "shardings.mesh")
    assert _allowed("mnemojax.serving.app", "mnemojax.engine.async_llm")


def test_string_literals_are_valid_unicode():
    """No string literal of the packages or scripts spells a lone surrogate (an unescaped `\\ud800` in a docstring):
    Python 3.11 compiles one, Python 3.13 fails to import the module (UnicodeEncodeError), as
    mnemojax.serving.protocol did."""
    paths = list(_modules().values())
    for folder in ("scripts",):
        paths += [os.path.join(REPO, folder, f) for f in os.listdir(os.path.join(REPO, folder)) if f.endswith(".py")]
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    node.value.encode("utf-8")
                except UnicodeEncodeError:
                    bad.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert not bad, f"lone surrogates in string literals (escape the backslash): {bad}"
