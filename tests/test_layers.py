"""The package's layering, read from the source: no module imports from a later layer
(docs/design.md, "Layers and imports"), function-level imports included, and no file
imports a private (underscore) name from another module."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qfuse"

# The table of docs/design.md, lowest first; a dotted name covers its submodules unless
# a longer name is listed. parallel/ and runtime/ span layers by file.
LAYERS = {
    "quant": 0, "levers": 0, "errors": 0, "corpus": 0, "runtime.host_copies": 0,
    # kernels/ by subject, in their own order (qfuse/kernels/__init__.py): what every
    # kernel uses, then one-row ops and the all-reduce, then products and attention.
    "kernels.common": 1, "kernels.pointwise": 1.1, "kernels.comm": 1.1,
    "kernels.products": 1.2, "kernels.attention": 1.2, "kernels": 1.3, "reference": 1,
    "choose": 2, "plan": 2, "ops": 2, "testing": 2,
    # runtime/ spans layers by file: the caches and their graphs with the models, the
    # generate loop and what it draws on above them
    "models": 3, "runtime.cache": 3, "runtime.paged_cache": 3, "runtime.paged_graphs": 3,
    "runtime.slotted_graphs": 3, "runtime.prefix_cache": 3, "runtime.prompt_write": 3,
    "runtime.prefill_graphs": 3,
    "formats": 3.5,
    "parallel.comm": 3, "parallel.sharding": 3, "parallel.layers": 3, "parallel.stopping": 3,
    "runtime.sampling": 4, "runtime.prompts": 4, "runtime.detokenize": 4,
    "runtime.generation": 4, "runtime": 4, "generation": 4,
    "loading": 4, "saving": 4, "train": 4, "oracle": 4, "schedule": 4, "executor": 4,
    "chat": 5, "from_flags": 5, "convert": 5, "api": 5, "parallel.runtime": 5,
    # gates/: what both gates measure with and the golden file, the two gates and the
    # quantization cost, then `qfuse gate` over them
    "gates.measures": 6, "gates.golden_io": 6, "gates.compat_gate": 6.01,
    "gates.oracle_gate": 6.01, "gates.quant_cost": 6.01, "gates.command": 6.02, "gates": 6.02,
    # serving/'s engine and its parts sit under the rest of serving/, in their own order
    # (docs/serving.md): what callers hand it, the sampler and scheduler, emission, the
    # prefill and step runners, then the engine.
    "serving.requests": 6.1, "serving.buckets": 6.1, "serving.sampler": 6.2,
    "serving.scheduler": 6.2, "serving.emission": 6.3, "serving.prefill": 6.4,
    "serving.slotted_steps": 6.4, "serving.paged_steps": 6.4, "serving.engine": 6.5,
    "serving": 7, "parallel.gate": 7, "parallel.serve": 7, "parallel": 7,
    "bench": 8, "parallel.bench": 8,
    "commands": 9, "commands.console": 10, "__main__": 10,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(name: str) -> int | None:
    """The layer of a qfuse module by its dotted name inside the package (None: the
    package itself)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    return None


def imported_modules(path: Path):
    """(line, dotted name inside qfuse) for every import of a qfuse module in a file."""
    here = module_name(path).split(".") if path.is_relative_to(PACKAGE) else []
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("qfuse."):
                    yield node.lineno, alias.name[len("qfuse."):]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "qfuse" or node.module.startswith("qfuse.")):
                target = node.module[len("qfuse."):] if node.module != "qfuse" else ""
            else:
                continue
            for alias in node.names:
                # `from . import x` imports module x when x is a module of that package
                sub = ".".join(p for p in (target, alias.name) if p)
                is_module = (PACKAGE / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (PACKAGE / Path(*sub.split("."))).is_dir()
                name = sub if is_module else target
                if name:
                    yield node.lineno, name


def package_files():
    return sorted(p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts)


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in package_files()
                if module_name(p) and layer(module_name(p)) is None]
    assert not unplaced, f"add these to LAYERS and docs/design.md: {unplaced}"


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_back_up(path):
    own = layer(module_name(path)) if module_name(path) else None
    if own is None:
        return  # qfuse/__init__.py re-exports the API: its imports are the API's
    later = [(line, name, layer(name)) for line, name in imported_modules(path)
             if layer(name) is not None and layer(name) > own]
    assert not later, f"{module_name(path)} (layer {own}) imports later layers: {later}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path):
    """(line, module, name) for each underscore name a file takes from another module:
    imported by name, or read as an attribute of a qfuse module it imported."""
    tree = ast.parse(path.read_text(), str(path))
    module_aliases = {}  # local name -> the qfuse module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if is_private(alias.name):
                    yield node.lineno, node.module, alias.name
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                qualified = (alias.name if isinstance(node, ast.Import)
                             else f"{'.' * node.level}{node.module or ''}.{alias.name}")
                if alias.asname or isinstance(node, ast.ImportFrom):
                    module_aliases[alias.asname or alias.name] = qualified
        # ws = pytest.importorskip("qfuse...") or importlib.import_module("qfuse...")
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "attr", None) in ("importorskip", "import_module")
                and node.value.args and isinstance(node.value.args[0], ast.Constant)):
            module_aliases[node.targets[0].id] = str(node.value.args[0].value)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases and is_private(node.attr)
                and module_aliases[node.value.id].startswith((".", "qfuse"))):
            yield node.lineno, module_aliases[node.value.id], node.attr


@pytest.mark.parametrize("folder", ["qfuse", "tests", "bench"])
def test_no_private_name_is_used_across_files(folder):
    found = [(str(p.relative_to(ROOT)), *hit) for p in sorted((ROOT / folder).rglob("*.py"))
             for hit in private_uses(p)]
    assert not found, f"underscore names are private to their file: {found}"


def test_the_checker_sees_a_private_attribute(tmp_path):
    """The rule can fail: reading a module's underscore attribute is reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("from qfuse.kernels.common import codes as c\nc._hidden(1)\nc.public(2)\n"
                     "w = pytest.importorskip('qfuse.kernels.common.codes')\nw._other\n")
    assert sorted(private_uses(probe)) == [(2, "qfuse.kernels.common.codes", "_hidden"),
                                           (5, "qfuse.kernels.common.codes", "_other")]


def test_the_checker_sees_a_backward_import(tmp_path, monkeypatch):
    """The rule can fail: a reference module importing ops is reported."""
    fake = PACKAGE / "reference.py"
    source = "from . import ops\nfrom .kernels.common import codes\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == fake
                        else Path.read_bytes(self).decode())
    names = [name for _, name in imported_modules(fake)]
    assert names == ["ops", "kernels.common.codes"]
    assert layer("ops") > layer(module_name(fake))


def test_architecture_page_lists_every_module():
    """docs/architecture.md's module table names every module of the package (a folder
    row covers its files)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page[page.index("| module | what it is |"):]
    table = table.split("\n\n")[0]
    named = set()
    for row in table.splitlines()[2:]:
        named.update(part.strip().strip("`").rstrip("/") for part in row.split("|")[1].split(","))
    missing = []
    for path in package_files():
        rel = path.relative_to(ROOT)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        if not any(str(rel).removesuffix(".py") == n.removesuffix(".py") or
                   str(rel).startswith(n + "/") for n in named):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md's module table lacks: {missing}"
