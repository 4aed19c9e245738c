"""The package's import graph: no cycles (counting imports inside functions too, which otherwise hide them), and no
pipeline stage imports a later one, so each stage can be read and changed without the ones downstream of it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "eagle3_train"
# pipeline order (prepare runs on generate's output); the other packages are shared infrastructure
STAGES = {"generate": 0, "data": 1, "vocab": 2, "hidden_states": 3, "train": 4, "export": 5, "evaluate": 6}
ORCHESTRATORS = {"cli", "pipeline"}  # they run every stage


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        name = ".".join(("eagle3_train", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
        out[name] = p
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3_train"):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_no_stage_imports_a_later_stage():
    wrong = []
    for src, targets in _graph().items():
        a = _package(src)
        if a in ORCHESTRATORS:
            continue
        for dst in targets:
            b = _package(dst)
            if b not in STAGES or b == a:
                continue
            if a not in STAGES or STAGES[a] < STAGES[b]:
                wrong.append(f"{src} -> {dst}")
    assert wrong == []


def test_benchmark_scripts_share_only_common():
    """Benchmark scripts are programs, not a library: what they share lives in `benchmarks/common.py`, and no script
    imports another (a script's edit cannot break a second one that borrowed its helpers)."""
    bench = SRC.parents[1] / "benchmarks"
    scripts = {p.stem for p in bench.glob("*.py")}
    borrowed = {}
    for p in bench.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if others := {n for n in names if n in scripts and n != "common"}:
                borrowed[p.name] = sorted(others)
    assert "common" in scripts and borrowed == {}, borrowed


# The tables that may name a draft layer kind: the kinds themselves, their torch side, the MLA module; and the
# verifier-family table, whose "mla" is the verifier's attention (another axis).
KIND_TABLES = {"model/layer_kinds.py", "model/architectures.py", "model/mla.py", "assets/families.py"}


def _string_constants(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.value, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_layer_kinds_are_named_only_in_their_tables():
    """A new draft layer kind is one entry in model/layer_kinds.py and its torch side, not `== "mla"` branches."""
    from eagle3_train.model.architectures import ARCHITECTURES
    from eagle3_train.model.layer_kinds import LAYER_KINDS

    assert set(ARCHITECTURES) == set(LAYER_KINDS)
    named = [f"{p.relative_to(SRC)}:{line}" for p in SRC.rglob("*.py") if str(p.relative_to(SRC)) not in KIND_TABLES
             for value, line in _string_constants(p) if value == "mla"]
    assert named == []


def test_the_kind_finder_finds_a_branch(tmp_path):
    branch = tmp_path / "x.py"
    branch.write_text('"""doc: mla"""\nif cfg.architecture == "mla":\n    pass\n')
    assert _string_constants(branch) == [("mla", 2)]
