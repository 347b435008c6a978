"""The package's layers, enforced: imports point down only, no import cycle, no private name imported across modules,
the torch-only layers never import Lightning, and ``import lightning_mtraining.ring`` runs without it.

Layers, lowest first (``lightning_mtraining/__init__.py`` draws them): the kernels, then ``core``, ``sparsity``,
``ring``, ``distributed``, ``hf``, then ``metrics`` and ``data``, ``callbacks``, ``strategies``, and the package's own
``__init__`` and registration on top. Every import counts, also one inside a function: a lazy import up the layers
is still a dependency up the layers. The imports are read from the source (``ast``), so a new module is checked
without being listed here.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = {
    "mtraining_kernels": 0,
    "lightning_mtraining.core": 1,
    "lightning_mtraining.sparsity": 2,
    "lightning_mtraining.ring": 3,
    "lightning_mtraining.distributed": 4,
    "lightning_mtraining.hf": 5,
    "lightning_mtraining.metrics": 6,
    "lightning_mtraining.data": 6,
    "lightning_mtraining.callbacks": 7,
    "lightning_mtraining.strategies": 8,
    "lightning_mtraining": 9,  # __init__ and _registration
}
TORCH_ONLY = 5  # up to hf: no Lightning
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")


# what pyproject.toml installs: the import packages, and the folder of each top-level one (the kernels live in
# kernels/ and are imported as mtraining_kernels)
SETUPTOOLS = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIRS = {"lightning_mtraining": "lightning_mtraining", **SETUPTOOLS["package-dir"]}


def _module_name(path: pathlib.Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    package = next(p for p, d in PACKAGE_DIRS.items() if d == folder)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _layer(module: str) -> int:
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return LAYERS[best]


def _modules() -> dict[str, pathlib.Path]:
    files = [p for d in PACKAGE_DIRS.values() for p in ROOT.joinpath(d).rglob("*.py")]
    return {_module_name(p): p for p in files}


def _imports(path: pathlib.Path, module: str, is_package: bool) -> list[tuple[str, tuple[str, ...], int]]:
    """``(imported module, imported names, line)`` for every import statement of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, (), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base]) if base else ".".join(pkg)
            out.append((base, tuple(a.name for a in node.names), node.lineno))
    return out


def _resolve(target: str, names: tuple[str, ...], modules: dict[str, pathlib.Path]) -> list[str]:
    """The package modules an import statement reaches (``from pkg import submodule`` reaches the submodule)."""
    found = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    if target in modules and len(found) < len(names):
        found.append(target)
    return found


def _graph():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    records = []
    for module, path in modules.items():
        for target, names, line in _imports(path, module, path.name == "__init__.py"):
            records.append((module, target, names, line))
            for dep in _resolve(target, names, modules):
                if dep != module:
                    edges[module].add(dep)
    return modules, edges, records


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages (discovery would install kernels/ as ``kernels``): every folder of the two
    import packages that has an ``__init__.py`` is listed, and nothing else."""
    found = {_module_name(p.parent / "__init__.py") for d in PACKAGE_DIRS.values()
             for p in ROOT.joinpath(d).rglob("__init__.py")}
    assert found == set(SETUPTOOLS["packages"]), (sorted(found - set(SETUPTOOLS["packages"])),
                                                   sorted(set(SETUPTOOLS["packages"]) - found))


def test_imports_point_down_the_layers():
    modules, edges, _ = _graph()
    upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
              for m in modules for d in sorted(edges[m]) if _layer(d) > _layer(m)]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_no_import_cycle():
    modules, edges, _ = _graph()
    # a package's __init__ re-exports its own submodules; those edges go down into the package, not across it
    edges = {m: {d for d in ds if not (modules[m].name == "__init__.py" and d.startswith(m + "."))}
             for m, ds in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# Modules of Triton / Gluon device functions shared by the kernel files of one family; device functions keep the
# leading underscore Triton's own kernels use (``@triton.jit def _attn_fwd_inner``), so they are exempt. Only the
# device functions: the host helpers of the launchers are public (mtraining_kernels.host, or the family's module).
JIT_HELPERS = ("mtraining_kernels.triton_common", "mtraining_kernels.gluon_common")


def _jit_functions(path: pathlib.Path) -> set[str]:
    """Names of the file's functions decorated with a ``jit`` (``@triton.jit``, ``@gluon.jit(...)``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(target, ast.Attribute) and target.attr == "jit":
                    names.add(node.name)
    return names


def test_no_private_name_is_imported_across_modules():
    modules, _, records = _graph()
    device = {m: _jit_functions(modules[m]) for m in JIT_HELPERS}
    assert all(device.values()), device  # the exemption still names modules of jit functions
    bad = [f"{m}:{line} imports {n} from {t}" for m, t, names, line in records
           if t.startswith(("lightning_mtraining", "mtraining_kernels")) and t in modules
           for n in names if n.startswith("_") and not n.startswith("__")
           and n not in device.get(t, ())
           and not (t == m and f"{t}.{n}" in modules)]  # a package importing its own private submodule
    assert not bad, "private names used across modules (give them a public name inside their layer):\n" + "\n".join(bad)


def test_the_torch_only_layers_never_import_lightning():
    modules, _, records = _graph()
    bad = [f"{m}:{line} imports {t}" for m, t, _, line in records
           if _layer(m) <= TORCH_ONLY and t.split(".")[0] in LIGHTNING]
    assert not bad, "\n".join(bad)
    kernels = [f"{m}:{line} imports {t}" for m, t, _, line in records
               if _layer(m) == 0 and t.split(".")[0] == "lightning_mtraining"]
    assert not kernels, "the kernels know nothing of the package:\n" + "\n".join(kernels)


@pytest.mark.parametrize("module", ["lightning_mtraining.ring", "lightning_mtraining.hf"])
def test_torch_only_users_do_not_import_lightning(module):
    code = (f"import sys, {module} as m, lightning_mtraining as lm; "
            "assert lm.ring_attention and lm.SparsityConfig and lm.balance.ring_work; "
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('lightning', 'pytorch_lightning', "
            "'lightning_fabric')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
def test_importing_the_package_registers_the_strategy_names_whenever_lightning_is_imported():
    """``import lightning_mtraining`` before Lightning, after it, or with Fabric alone: the names are registered
    (Note [Registering without importing Lightning])."""
    names = "sorted(k for k in R if k.startswith('mtraining'))"
    cases = {
        "before": ("import lightning_mtraining; import lightning; "
                   "from lightning.pytorch.strategies import StrategyRegistry as R; print(" + names + ")"),
        "after": ("import lightning; import lightning_mtraining; "
                  "from lightning.pytorch.strategies import StrategyRegistry as R; print(" + names + ")"),
        "fabric": ("import lightning_mtraining; from lightning.fabric.strategies import STRATEGY_REGISTRY as R; "
                   "print(" + names + ")"),
    }
    trainer = "['mtraining', 'mtraining_dense', 'mtraining_fsdp', 'mtraining_fsdp_dense']"
    for case, code in cases.items():
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (case, out.stderr[-3000:])
        want = "['mtraining', 'mtraining_dense']" if case == "fabric" else trainer
        assert out.stdout.strip().splitlines()[-1] == want, (case, out.stdout)


def test_names_exported_before_the_split_still_resolve_with_a_deprecation_warning():
    """The top level is the small API; the names it exported before the layers keep working from it, each with a
    ``DeprecationWarning`` naming its layer's namespace, where it is the same object. The small API warns nothing."""
    import warnings

    import lightning_mtraining as lm

    for name, module in lm._DEPRECATED.items():
        layer = ".".join(module.split(".")[:2])
        want = rf"^lightning_mtraining\.{name} is deprecated: use {layer}\.{name}$"
        with pytest.warns(DeprecationWarning, match=want):
            value = getattr(lm, name)
        assert value is getattr(__import__(layer, fromlist=[name]), name)
        assert name not in dir(lm) and name not in lm.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in lm.__all__:
            getattr(lm, name)
        assert lm.causal_lm_targets is lm.hf.causal_lm_targets


def test_kernel_tooling_moved_to_testing_still_resolves_with_a_deprecation_warning():
    """The tests' and benchmarks' tooling moved out of the runtime kernels into ``mtraining_kernels.testing``; the old
    import paths keep working for code outside this repository, each with a ``DeprecationWarning`` naming the new one,
    and give the same object. The runtime references stay and warn nothing."""
    import importlib
    import warnings

    from mtraining_kernels import reference, testing

    for name in ("check_half_precision", "HALF_PRECISION_CASES", "tile_lists_mask", "attention_chunked_ref"):
        with pytest.warns(DeprecationWarning, match=rf"^mtraining_kernels\.reference\.{name} is deprecated: use "
                                                    rf"mtraining_kernels\.testing\.{name}$"):
            value = getattr(reference, name)
        assert value is getattr(testing, name)
    with pytest.warns(DeprecationWarning, match="check_half_precision"):
        from mtraining_kernels.reference import check_half_precision
    assert check_half_precision is testing.check_half_precision
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        reference.nothing  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reference.attention_ref and reference.vertical_slash_mask and reference.tile_rows_mask

    pytest.importorskip("triton")
    sys.modules.pop("mtraining_kernels.gluon_tooling", None)
    with pytest.warns(DeprecationWarning, match=r"mtraining_kernels\.gluon_tooling is deprecated: use "
                                                r"mtraining_kernels\.testing\.gluon"):
        old = importlib.import_module("mtraining_kernels.gluon_tooling")
    assert old.compile_report is importlib.import_module("mtraining_kernels.testing.gluon").compile_report
