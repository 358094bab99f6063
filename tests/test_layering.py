"""The package's layering, read from its source: no import cycle between packages (function-local
imports counted), ``pipeline/`` without Lightning, HTTP or model imports, and the leaves (``errors``,
``registry``, the config schema) importing nothing of the package but ``errors``."""

import ast
import os

from tests.helpers.paths import REPO

PACKAGE = os.path.join(REPO, "lightning_fasync")


def _imports(path, root=REPO):
    """Every module ``path`` imports (relative imports resolved), at any depth."""
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    module = rel.removesuffix(".__init__")
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # The module, and each name taken from it as a submodule may be (``from lightning_fasync
            # import engine``, ``from torch import nn``): a name that is not one is harmless here.
            out += [source] + [f"{source}.{a.name}" for a in node.names if a.name != "*"]
    return module, out


def _modules():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                yield _imports(os.path.join(root, name))


def _unit(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_import_cycle_between_packages():
    edges = {}
    for module, imported in _modules():
        src = _unit(module)
        for name in imported:
            if name.startswith("lightning_fasync.") and src is not None and _unit(name) != src:
                edges.setdefault(src, set()).add(_unit(name))
    # Every package's reach; a package that reaches itself through another is on a cycle.
    cycles = []
    for start in edges:
        seen, todo = set(), list(edges[start])
        while todo:
            unit = todo.pop()
            if unit == start:
                cycles.append(start)
                break
            if unit not in seen:
                seen.add(unit)
                todo += edges.get(unit, ())
    assert not cycles, f"packages on an import cycle: {sorted(cycles)} (edges: {edges})"


def test_pipeline_imports_no_lightning_http_or_model_code():
    heavy = ("lightning", "aiohttp", "transformers", "torch.nn", "lightning_fasync.lightning", "lightning_fasync.fleet",
             "lightning_fasync.engine", "lightning_fasync.weights", "lightning_fasync.trainers", "lightning_fasync.policy")
    checked = 0
    for module, imported in _modules():
        if module.startswith("lightning_fasync.pipeline"):
            checked += 1
            bad = [n for n in imported if any(n == h or n.startswith(h + ".") for h in heavy)]
            assert not bad, f"{module} imports {bad}"
    assert checked >= 10, f"only {checked} pipeline modules found under {PACKAGE}"


def test_a_name_imported_from_a_package_counts_as_its_submodule(tmp_path):
    path = tmp_path / "lightning_fasync" / "pipeline" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text("from lightning_fasync import engine\nfrom torch import nn\nfrom .. import fleet\n")
    _, imported = _imports(str(path), root=str(tmp_path))
    assert {"lightning_fasync.engine", "torch.nn", "lightning_fasync.fleet"} <= set(imported)


def test_the_leaves_import_only_errors():
    for leaf in ("lightning_fasync.errors", "lightning_fasync.registry", "lightning_fasync.config.schema"):
        (imported,) = [i for m, i in _modules() if m == leaf]
        ours = {n for n in imported if n.startswith("lightning_fasync")}
        assert all(n == "lightning_fasync.errors" or n.startswith("lightning_fasync.errors.") for n in ours), \
            f"{leaf} imports {sorted(ours)}"
