"""The layout is the architecture (README): comm and kernels at the bottom, sp above them, the trainer's
modules above that, apps/ on top. These checks read the import statements of every module of
lingua_zeco/ and apps/ (module level and inside functions) and fail on an import that points up, an
import cycle, a private name taken from another module, fla's internal stages used outside kernels/, or
an import that goes around a package's __init__ (lingua_zeco/checkpoint/: one home, one interface).
They also bound the sizes that keep the tree readable: the modules directly under lingua_zeco/, the
lines of any module, and the parameters of the public functions of sp/ and kernels/."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOTTOM = ("lingua_zeco.comm", "lingua_zeco.kernels")  # each imports only itself
CHECKPOINT = "lingua_zeco.checkpoint"
RELIABILITY = "lingua_zeco.reliability"
CHECKPOINT_NEEDS = ("lingua_zeco.args", "lingua_zeco.reliability")  # all it imports from the project
MAX_TOP_MODULES = 12  # .py files directly under lingua_zeco/ (not __init__.py): the rest lives in packages
MAX_LINES = 400  # any .py file under lingua_zeco/ or apps/
MAX_PARAMS = 8  # a public function of sp/ or kernels/ (self/cls not counted): more wants a settings object
PARAM_CHECKED = ("lingua_zeco/sp", "lingua_zeco/kernels")


def python_files(*tops: str) -> dict[str, str]:
    """{path relative to the repository: text} of every .py file under the given folders."""
    out = {}
    for top in tops:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    out[os.path.relpath(path, ROOT)] = open(path).read()
    return out


def module_name(rel_path: str) -> str:
    name = rel_path[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def read_imports() -> dict[str, list[tuple[str, str]]]:
    """{module: [(imported module, imported name or ""), ...]} for every .py under lingua_zeco/ and apps/."""
    texts = python_files("lingua_zeco", "apps")
    found = {module_name(path): path for path in texts}
    imports = {}
    for mod, path in found.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        pairs = []
        for node in ast.walk(ast.parse(texts[path], path)):
            if isinstance(node, ast.Import):
                pairs += [(a.name, "") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (base + "." + node.module if node.module else base) if node.level else node.module
                for a in node.names:  # `from pkg import submodule` is an import of the submodule
                    sub = f"{target}.{a.name}"
                    pairs.append((sub, "") if sub in found else (target, a.name))
        imports[mod] = pairs
    return imports


def project_edges(imports) -> dict[str, set[str]]:
    return {m: {t for t, _ in pairs if t in imports and t != m} for m, pairs in imports.items()}


def rank(mod: str) -> int:
    if mod.startswith(BOTTOM):
        return 0
    if mod.startswith("lingua_zeco.sp"):
        return 1
    return 2 if mod.startswith("lingua_zeco") else 3


def upward_imports(edges) -> list[str]:
    bad = []
    for m, targets in edges.items():
        for t in targets:
            if m.startswith(BOTTOM):
                ok = t.startswith(".".join(m.split(".")[:2]))  # only its own package
            else:
                ok = rank(t) <= rank(m)
            if not ok:
                bad.append(f"{m} -> {t}")
    return sorted(bad)


def cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def private_imports(imports) -> list[str]:
    return sorted(f"{m}: {t}.{name}" for m, pairs in imports.items() for t, name in pairs
                  if name.startswith("_") and t.startswith(("lingua_zeco", "apps")))


def fla_internals_outside_kernels(imports) -> list[str]:
    """fla.ops.<family> is fla's public API; anything deeper (chunk stages, fla.ops.utils, fla.ops.common)
    is internal and may change with any fla release: only lingua_zeco/kernels/ imports it."""
    def internal(t):
        deep = t.startswith("fla.ops.") and t.count(".") >= 3
        return deep or t.startswith(("fla.ops.utils", "fla.ops.common"))
    return sorted(f"{m}: {t}" for m, pairs in imports.items() for t, _ in pairs
                  if internal(t) and not m.startswith("lingua_zeco.kernels"))


def package_api(package: str) -> set[str]:
    """The names a package lists in `__all__` (read from its __init__.py, not imported)."""
    path = os.path.join(ROOT, *package.split("."), "__init__.py")
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def around_the_package(imports, package: str, public: set[str]) -> list[str]:
    """Imports from outside `package` that bypass its __init__: `from package.sub import x`, a submodule
    the package does not list in `__all__`, or a name from the package that `__all__` does not list."""
    bad = []
    for m, pairs in imports.items():
        if m == package or m.startswith(package + "."):
            continue
        for t, name in pairs:
            if t == package:
                ok = not name or name in public
            elif t.startswith(package + "."):
                ok = not name and t[len(package) + 1:] in public
            else:
                continue
            if not ok:
                bad.append(f"{m}: {t}" + (f" import {name}" if name else ""))
    return sorted(bad)


def package_needs(edges, package: str, allowed: tuple[str, ...]) -> list[str]:
    """What the package's modules import from the rest of the project beyond `allowed`."""
    return sorted(f"{m} -> {t}" for m, targets in edges.items() if m == package or m.startswith(package + ".")
                  for t in targets if t != package and not t.startswith((package + ".", *allowed)))


def top_level_modules(paths) -> list[str]:
    """The modules directly under lingua_zeco/ among `paths` (its __init__.py not counted)."""
    return sorted(p for p in paths if os.path.dirname(p) == "lingua_zeco" and os.path.basename(p) != "__init__.py")


def long_files(texts: dict[str, str], most: int = MAX_LINES) -> list[str]:
    return sorted(f"{p}: {n} lines" for p, t in texts.items() if (n := len(t.splitlines())) > most)


def _dotted(node) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _n_params(fn) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def too_many_parameters(source: str, where: str, most: int = MAX_PARAMS) -> list[str]:
    """Public functions of one module (module level, and methods of its public classes) that take more
    than `most` parameters. Triton kernels (triton.jit: their arguments are the launch's pointers and
    constants) and the forward/backward of torch.autograd.Function subclasses (their signature is the
    autograd contract) are exempt."""
    def public_functions():
        for node in ast.parse(source, where).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield "", node
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                autograd = any(_dotted(b) in ("torch.autograd.Function", "autograd.Function", "Function")
                               for b in node.bases)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (
                            autograd and item.name in ("forward", "backward")):
                        yield node.name + ".", item

    bad = []
    for owner, fn in public_functions():
        jit = any(_dotted(d) in ("triton.jit", "jit") for d in fn.decorator_list)
        if not fn.name.startswith("_") and not jit and (n := _n_params(fn)) > most:
            bad.append(f"{where}:{fn.lineno} {owner}{fn.name}: {n} parameters")
    return bad


IMPORTS = read_imports()


def test_the_tree_is_read():
    assert {"lingua_zeco.comm.all_scan", "lingua_zeco.sp.fused_zeco", "apps.gla.train"} <= set(IMPORTS)
    assert "lingua_zeco.comm.scan" in project_edges(IMPORTS)["lingua_zeco.comm.all_scan"]


def test_imports_point_down_only():
    assert upward_imports(project_edges(IMPORTS)) == []


def test_no_import_cycles():
    assert cycles(project_edges(IMPORTS)) == []


def test_modules_use_each_others_public_names_only():
    assert private_imports(IMPORTS) == []


def test_fla_internal_stages_only_in_kernels():
    assert fla_internals_outside_kernels(IMPORTS) == []


def test_checkpoint_package_is_one_interface():
    """Outside lingua_zeco/checkpoint/ only `from lingua_zeco.checkpoint import <public name>`; inside, it
    imports nothing from the project but args and reliability (not the trainer's modules, not apps/)."""
    public = package_api(CHECKPOINT)
    assert {"CheckpointManager", "run_dir"} <= public
    assert any(t == CHECKPOINT for pairs in IMPORTS.values() for t, _ in pairs)  # the check reads real imports
    assert around_the_package(IMPORTS, CHECKPOINT, public) == []
    assert package_needs(project_edges(IMPORTS), CHECKPOINT, CHECKPOINT_NEEDS) == []


def test_reliability_package_is_one_interface():
    """lingua_zeco/reliability/ (split by job) is used through its __init__ only, and needs nothing of the
    project but args: every module may report its errors through it."""
    public = package_api(RELIABILITY)
    assert {"StepGuard", "clean_exit", "ReliabilityArgs"} <= public
    assert any(t == RELIABILITY for pairs in IMPORTS.values() for t, _ in pairs)
    assert around_the_package(IMPORTS, RELIABILITY, public) == []
    assert package_needs(project_edges(IMPORTS), RELIABILITY, ("lingua_zeco.args",)) == []


def test_few_modules_directly_under_the_package():
    """Modules go into packages by purpose (checkpoint/, data/, reliability/, ...) rather than pile up."""
    modules = top_level_modules(python_files("lingua_zeco"))
    assert "lingua_zeco/distributed.py" in modules  # the check reads real files
    assert len(modules) <= MAX_TOP_MODULES, modules


def test_no_module_is_long():
    texts = python_files("lingua_zeco", "apps")
    assert "apps/gla/train.py" in texts
    assert long_files(texts) == []


def test_public_functions_of_sp_and_kernels_take_few_parameters():
    """More than MAX_PARAMS parameters means options travel one by one through every layer: they belong
    in a settings object (kernels.GLAOptions, sp.SPContext) passed as one."""
    texts = python_files(*PARAM_CHECKED)
    assert any(p.endswith(os.path.join("sp", "__init__.py")) for p in texts)
    assert [b for p, t in sorted(texts.items()) for b in too_many_parameters(t, p)] == []


@pytest.mark.parametrize("case", ["up", "cycle", "private", "fla", "package", "size", "params"])
def test_the_checks_catch_a_broken_layout(case):
    """Each check on a small made-up tree with one violation (the checks above could otherwise pass by
    reading nothing)."""
    if case == "up":
        assert upward_imports({"lingua_zeco.comm.scan": {"lingua_zeco.sp.delta"}}) == [
            "lingua_zeco.comm.scan -> lingua_zeco.sp.delta"]
        assert upward_imports({"lingua_zeco.kernels.naive": {"lingua_zeco.comm.scan"}}) != []
        assert upward_imports({"lingua_zeco.checkpoint": {"apps.gla.model"}}) != []
    elif case == "cycle":
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
        assert cycles(edges) == [["a", "b", "c"]]
    elif case == "private":
        assert private_imports({"lingua_zeco.sp.delta": [("lingua_zeco.comm.scan", "_k_blocks")]}) != []
    elif case == "package":
        public = {"CheckpointManager", "run_dir"}
        imports = {"apps.gla.train": [(CHECKPOINT, "CheckpointManager"), (CHECKPOINT + ".run_dir", "")],
                   "apps.gla.eval": [(CHECKPOINT + ".integrity", ""), (CHECKPOINT, "RUN_ID")],
                   "lingua_zeco.data.overlap": [(CHECKPOINT + ".integrity", "sha256")],
                   "lingua_zeco.checkpoint.manager": [(CHECKPOINT + ".integrity", "")]}
        assert around_the_package(imports, CHECKPOINT, public) == [
            "apps.gla.eval: lingua_zeco.checkpoint import RUN_ID", "apps.gla.eval: lingua_zeco.checkpoint.integrity",
            "lingua_zeco.data.overlap: lingua_zeco.checkpoint.integrity import sha256"]
        edges = {"lingua_zeco.checkpoint.manager": {"lingua_zeco.checkpoint.integrity", "lingua_zeco.reliability",
                                                    "lingua_zeco.evaluation", "apps.gla.model"}}
        assert package_needs(edges, CHECKPOINT, CHECKPOINT_NEEDS) == [
            "lingua_zeco.checkpoint.manager -> apps.gla.model",
            "lingua_zeco.checkpoint.manager -> lingua_zeco.evaluation"]
    elif case == "size":
        paths = ["lingua_zeco/__init__.py", "lingua_zeco/args.py", "lingua_zeco/sp/gla.py", "apps/gla/train.py"]
        assert top_level_modules(paths) == ["lingua_zeco/args.py"]
        assert long_files({"a.py": "x = 1\n" * 401, "b.py": "x = 1\n" * 400}) == ["a.py: 401 lines"]
    elif case == "params":
        source = """
import triton
import torch


def nine(a, b, c, d, e, f, g, h, i): ...
def eight(a, b, c, d, e, f, g, h=1, *, i=None): ...
def star(a, b, c, d, e, f, g, *args, **kwargs): ...
def _private(a, b, c, d, e, f, g, h, i): ...
@triton.jit
def kernel(a, b, c, d, e, f, g, h, i): ...
class Op(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c, d, e, f, g, h, i): ...
    @staticmethod
    def apply_all(ctx, a, b, c, d, e, f, g, h): ...
class Options:
    def method(self, a, b, c, d, e, f, g, h): ...
    def wide(self, a, b, c, d, e, f, g, h, i): ...
    @classmethod
    def make(cls, a, b, c, d, e, f, g, h): ...
"""
        assert too_many_parameters(source, "m.py") == [
            "m.py:6 nine: 9 parameters", "m.py:7 eight: 9 parameters", "m.py:8 star: 9 parameters",
            "m.py:16 Op.apply_all: 9 parameters", "m.py:19 Options.wide: 9 parameters"]
    else:
        imports = {"lingua_zeco.sp.fused_zeco": [("fla.ops.gla.chunk", "chunk_gla_fwd_o_gk")],
                   "apps.gla.bench.bench_op": [("fla.ops.gla", "chunk_gla")],
                   "lingua_zeco.kernels.fla_stages": [("fla.ops.common.chunk_h", "chunk_fwd_h")]}
        assert fla_internals_outside_kernels(imports) == ["lingua_zeco.sp.fused_zeco: fla.ops.gla.chunk"]
