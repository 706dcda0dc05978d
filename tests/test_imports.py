"""The package's import structure: no module imports its importer (a cycle), counting imports inside functions,
and the planner and the model analysis stay light (no Lightning, no distributed runtime)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_autopar"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``module`` imports anywhere in its source (top level or inside functions): for
    ``from a.b import c`` the module ``a.b.c`` when it is one, else ``a.b``. Parent packages, which Python imports
    on the way, are not counted (they are not the importer's choice)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        found |= {t for t in targets if t in known and t != module and not module.startswith(t + ".")}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = module_names()
    graph = {m: imported(m, p, known) for m, p in known.items()}
    assert len(graph) > 40  # the whole package was read
    assert any("lightning_autopar.planner.search" in deps for deps in graph.values())  # imports were resolved
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_planner_and_analysis_load_no_lightning_and_no_distributed_runtime():
    """In a fresh interpreter: what ``import lightning_autopar.planner, lightning_autopar.profile.analyze`` loads
    beyond ``import torch`` holds no Lightning module and no torch.distributed module (``import torch`` itself
    loads the ``torch.distributed`` package in torch 2.13; nothing of its runtime -- process groups, DeviceMesh,
    FSDP, DTensor, pipelining -- may come on top)."""
    code = ("import sys, torch; before = set(sys.modules); "
            "import lightning_autopar.planner, lightning_autopar.profile.analyze; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "lightning_autopar.planner.search" in out and "lightning_autopar.profile.analyze" in out
    heavy = [m for m in out if m.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
             or m.startswith("torch.distributed")]
    assert heavy == []


# The layers, lowest first (ARCHITECTURE.md "Layers"): a module may import its own layer and the ones below.
# ``launch`` is pure (a plan and a cluster in, suggested environment variables out) and sits with the specs; the
# ``cli_*`` modules of every package, the config (it builds strategies and Trainers) and the package root (its
# lazy public API) sit on top with the entry points.
LAYERS = (
    ("specs", "errors", "files", "launch", "models", "data", "dims"),
    ("planner",),
    ("topology",),
    ("profile",),
    ("parallel",),
    ("runtime",),
    ("callbacks",),
    ("strategy", "fabric", "accelerate", "hf_trainer", "config", "cli", "cli_*", "simulate"),
    ("",),
)


def layer_of(module: str) -> int:
    """The rank of a package module in LAYERS: by its file name for ``cli_*`` modules, else by its first part."""
    parts = module.split(".")[1:]
    if parts and parts[-1].startswith("cli_"):
        parts = ["cli_*"]
    first = parts[0] if parts else ""
    for rank, names in enumerate(LAYERS):
        if first in names:
            return rank
    raise AssertionError(f"{module}: no layer in tests/test_imports.LAYERS; add its package there")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, deps in graph.items() for t in deps if layer_of(t) > layer_of(m))


def test_no_module_imports_a_layer_above_it():
    """Counting imports inside functions: the real graph, not the one the top of each file shows."""
    known = module_names()
    graph = {m: imported(m, p, known) for m, p in known.items()}
    assert upward_imports(graph) == []


def test_layer_check_finds_an_upward_import():
    graph = {"lightning_autopar.specs": {"lightning_autopar.runtime.step"},
             "lightning_autopar.runtime.step": {"lightning_autopar.specs"},
             "lightning_autopar.planner.cli_plan": {"lightning_autopar.profile.units"}}
    assert upward_imports(graph) == ["lightning_autopar.specs -> lightning_autopar.runtime.step"]


def meta_forward_sites(source: str) -> list[str]:
    """What in ``source`` runs a model of its own on swapped-in tensors, or stops a call on its own: every call of
    ``functional_call`` (the swap of parameters for meta tensors each meta forward makes), a definition of
    ``meta_forward``, and an exception class defined to stop a forward or a step at a module call (any class
    deriving from ``Exception`` or ``BaseException`` that is not the package's error type)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "functional_call":
                found.append(f"functional_call (line {node.lineno})")
        elif isinstance(node, ast.FunctionDef) and node.name == "meta_forward":
            found.append(f"def meta_forward (line {node.lineno})")
        elif isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in ("Exception", "BaseException")
                                                    for b in node.bases):
            found.append(f"class {node.name}({', '.join(b.id for b in node.bases)}) (line {node.lineno})")
    return found


def test_exactly_one_module_defines_the_meta_forward():
    """profile/trace.py alone swaps a model's parameters for meta tensors and runs it (``meta_forward``), and
    defines the one stop-at-call exception (``StopAtCall``, a BaseException); every other analysis records through
    its recorders. The package's error type (``errors.AutoparError``) and the pipeline's stage output (carried out
    of the user's forward at run time, not a trace) and the simulation's stop once torch's schedule has inferred
    a pipeline's shapes (a real step, not a trace) are not stop-at-call exceptions."""
    allowed_classes = {"lightning_autopar.errors": ["AutoparError"],
                       "lightning_autopar.parallel.pipeline.standins": ["StageOutput"],
                       "lightning_autopar.parallel.pipeline.stage": ["_ShapesInferred"]}
    sites = {}
    for module, path in module_names().items():
        found = [s for s in meta_forward_sites(path.read_text())
                 if not any(s.startswith(f"class {c}(") for c in allowed_classes.get(module, []))]
        if found:
            sites[module] = found
    trace = sites.pop("lightning_autopar.profile.trace", [])
    assert sites == {}, f"modules running a meta forward of their own: {sites}"
    assert any(s.startswith("def meta_forward") for s in trace) and any(s.startswith("functional_call") for s in trace)
    assert any(s.startswith("class StopAtCall(BaseException)") for s in trace)
    from lightning_autopar.profile.trace import StopAtCall

    assert not issubclass(StopAtCall, Exception)  # a user's ``except Exception`` lets it through


def test_meta_forward_finder_finds_a_meta_forward():
    source = ("from torch.func import functional_call\n"
              "class _Captured(Exception):\n    pass\n"
              "def run(model, state):\n    return functional_call(model, state, ())\n")
    assert meta_forward_sites(source) == ["class _Captured(Exception) (line 2)", "functional_call (line 5)"]
    assert meta_forward_sites("import torch\ndef f(m):\n    return m(torch.ones(1))\n") == []


PRIVATE_TP_NAMES = ("_StridedShard", "_concatenate", "_register_state_dict_hook")


def private_tp_uses(source: str) -> list[str]:
    """Where ``source``'s code (not its prose) names one of torch's private TP APIs (``PRIVATE_TP_NAMES``): an
    import of it, an attribute of that name, or a bare name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        else:
            continue
        found += [f"{n} (line {node.lineno})" for n in names if n in PRIVATE_TP_NAMES]
    return found


def test_private_dtensor_api_is_used_in_one_module():
    """``parallel/dtensor_private.py`` alone touches torch's private TP API (``_StridedShard``, the mesh
    concatenation, the state-dict hook), as ``parallel/pipeline/stage.py`` does for pipelining's; the others call
    its documented wrappers."""
    uses = {m: found for m, p in module_names().items() if (found := private_tp_uses(p.read_text()))}
    private = "lightning_autopar.parallel.dtensor_private"
    assert set(uses) == {private}, f"private TP API outside {private}: {uses}"
    assert any(u.startswith("_StridedShard") for u in uses[private])
    docs = ast.get_docstring(ast.parse(module_names()[private].read_text())) or ""
    assert "torch 2.13" in docs and all(name in docs for name in PRIVATE_TP_NAMES)


def test_private_use_finder_finds_code_not_prose():
    source = ('"""Uses ``_StridedShard``."""\n'
              "from torch.distributed.tensor.placement_types import _StridedShard\n"
              "def f(mesh):\n    return mesh._concatenate([mesh])\n")
    assert private_tp_uses(source) == ["_StridedShard (line 2)", "_concatenate (line 4)"]
