"""The import rule, checked on the source: heads <- data <- training and heads <- runtime <- bench; no circle
between modules; no import of our own modules inside a function body."""

from __future__ import annotations

import graphlib
import textwrap

import pytest

from tests.import_graph import build_graph, floors, module_files, upward_edges


def test_no_import_circle_between_modules():
    graph = build_graph()
    try:
        layered = floors(graph.edges)
    except graphlib.CycleError as error:
        pytest.fail(f"import circle: {' -> '.join(error.args[1])}")
    assert sum(len(f) for f in layered) == len(module_files())


def test_no_upward_import_between_packages():
    assert upward_edges(build_graph()) == []


def test_no_import_of_our_modules_inside_a_function_body():
    nested = [f"{module}:{line} imports {target}" for module, line, target in build_graph().nested]
    assert nested == [], "\n".join(nested)


def _write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checks_see_circles_upward_edges_and_nested_imports(tmp_path):
    """The graph reader on a made-up tree: each broken rule is found; TYPE_CHECKING imports are not edges."""
    _write(tmp_path, {
        "heads/__init__.py": "", "data/__init__.py": "", "training/__init__.py": "", "bench/__init__.py": "",
        "runtime/__init__.py": "",
        "runtime/a.py": "from runtime.b import x\n",
        "runtime/b.py": "from runtime import a\n",  # circle a <-> b
        "runtime/c.py": "import data.d\n",  # runtime must not import data
        "data/d.py": "def f():\n    from heads import e\n",  # nested
        "heads/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bench import z\n",
        "bench/z.py": "from runtime.c import y\n",
    })
    graph = build_graph(tmp_path)
    assert graph.edges["runtime.a"] == {"runtime.b"} and graph.edges["runtime.b"] == {"runtime.a"}
    assert graph.edges["heads.e"] == set()  # annotations only
    assert upward_edges(graph) == [("runtime.c", "data.d")]
    assert graph.nested == [("data.d", 2, "heads.e")]
    with pytest.raises(graphlib.CycleError):
        floors(graph.edges)
