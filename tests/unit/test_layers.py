"""The package's layering, read from its sources: every import (at module level or inside a
function) goes to the same folder or to a lower layer, and no modules import each other in a
circle. DESIGN.md draws the layers; LAYERS below is that drawing."""

from __future__ import annotations

import ast
from pathlib import Path

import localllm

PACKAGE = Path(localllm.__file__).resolve().parent

# Folder (or module) under localllm/ -> its layer. Equal numbers in different folders may
# not import each other (text and kernels are both above formats, beside each other).
LAYERS = {
    "errors": 0,
    "formats": 1,
    "text": 2, "kernels": 2,
    "backends": 3,
    "models": 4,
    "runtime": 5,
    "generation": 6,
    "": 7,                    # localllm/api.py and the package's own __init__.py
    "apps": 8,
    "testing": 9,             # what tests and scripts share: may use everything
}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (source file, is a package) for every module under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        out[module_name(path, root)] = (path, path.name == "__init__.py")
    return out


def imports_of(name: str, path: Path, is_pkg: bool, modules) -> set[str]:
    """The modules of ours that one module imports, anywhere in its source."""
    top = name.split(".")[0]
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import mod` imports the submodule; `from mod import name`, the module
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import a.b.c` names a.b.c; attributes fall off
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] == top and t != name:
                found.add(t)
    return found


def layer_of(name: str) -> tuple[str, int]:
    """(folder, layer) of a dotted module name of ours."""
    parts = name.split(".")[1:]
    folder = "" if parts[:1] in ([], ["api"]) else parts[0]  # api.py sits with __init__.py
    if folder not in LAYERS:
        raise KeyError(f"{name}: localllm/{folder} has no layer in LAYERS")
    return folder, LAYERS[folder]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import that goes to a higher layer, or sideways to another folder of its layer."""
    bad = []
    for src, targets in sorted(graph.items()):
        sf, sl = layer_of(src)
        for dst in sorted(targets):
            df, dl = layer_of(dst)
            if df != sf and dl >= sl:
                bad.append(f"{src} (layer {sl}) imports {dst} (layer {dl})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles: strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = read_modules(root)
    return {name: imports_of(name, path, is_pkg, modules)
            for name, (path, is_pkg) in modules.items()}


def test_every_import_goes_down_the_layers():
    graph = import_graph(PACKAGE)
    assert len(graph) > 100  # the whole package was read
    assert upward_imports(graph) == []


def test_no_import_circles():
    assert circles(import_graph(PACKAGE)) == []


def test_every_folder_has_a_layer():
    for child in PACKAGE.iterdir():
        if child.is_dir() and (child / "__init__.py").exists():
            assert child.name in LAYERS, child
        elif child.suffix == ".py" and child.stem != "__init__":
            assert child.stem in LAYERS or child.stem == "api", child


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "localllm"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "formats/__init__.py": "",
        "formats/gguf.py": "def f():\n    from localllm.runtime import sequence\n",
        "text/__init__.py": "",
        "text/tokenizer.py": "from ..kernels import ops\n",   # sideways: same layer
        "kernels/__init__.py": "",
        "kernels/ops.py": "from . import simd\n",
        "kernels/simd.py": "from .ops import x\n",             # a circle inside a folder
        "runtime/__init__.py": "",
        "runtime/sequence.py": "from localllm.formats.gguf import GGUFFile\n",
    })
    graph = import_graph(root)
    assert upward_imports(graph) == [
        "localllm.formats.gguf (layer 1) imports localllm.runtime.sequence (layer 5)",
        "localllm.text.tokenizer (layer 2) imports localllm.kernels.ops (layer 2)",
    ]
    assert circles(graph) == [["localllm.formats.gguf", "localllm.runtime.sequence"],
                              ["localllm.kernels.ops", "localllm.kernels.simd"]]
