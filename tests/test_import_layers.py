"""The lower layers import nothing of disagg above them (docs/ARCHITECTURE.md): the engine only
itself, the pipes only themselves, the lookup buffer itself and the pipes. Read with ast, nothing
imported; an import inside a function counts too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Leaf modules under every layer: they import nothing of disagg (checked below), so any layer may use them.
LEAVES = ("disagg.rate_limited_log", "disagg.timeline")
# package -> the disagg packages its modules may import
LAYERS = {
    "disagg.engine": ("disagg.engine",),
    "disagg.pipes": ("disagg.pipes", *LEAVES),
    "disagg.lookup_buffer": ("disagg.lookup_buffer", "disagg.pipes", *LEAVES),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def disagg_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each disagg module the file imports: `from disagg import metrics` is
    disagg.metrics, `from disagg import LLM` is disagg itself; relative imports resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
                      for alias in node.names]
    return [(line, name) for line, name in found if name == "disagg" or name.startswith("disagg.")]


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_nothing_of_disagg_above_it(layer: str):
    files = sorted(ROOT.joinpath(*layer.split(".")).rglob("*.py"))
    assert files, f"no modules under {layer}"
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in files
             for line, name in disagg_imports(path) if not within(name, LAYERS[layer])]
    assert not wrong, f"{layer} may import only {', '.join(LAYERS[layer])}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("leaf", LEAVES)
def test_a_leaf_module_imports_nothing_of_disagg(leaf: str):
    assert disagg_imports(ROOT.joinpath(*leaf.split(".")).with_suffix(".py")) == []


def test_the_walk_sees_each_form_of_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    engine = tmp_path / "disagg" / "engine"
    engine.mkdir(parents=True)
    for path in (tmp_path / "disagg" / "__init__.py", engine / "__init__.py", tmp_path / "disagg" / "metrics.py"):
        path.write_text("")
    (engine / "x.py").write_text("import os\n"
                                 "import disagg.api.app\n"
                                 "from disagg import metrics, LLM\n"
                                 "from .. import metrics\n"
                                 "from . import y\n"
                                 "def f():\n"
                                 "    from disagg.serving import z\n")
    assert sorted(disagg_imports(engine / "x.py")) == [
        (2, "disagg.api.app"), (3, "disagg"), (3, "disagg.metrics"), (4, "disagg.metrics"), (5, "disagg.engine"),
        (7, "disagg.serving")]
