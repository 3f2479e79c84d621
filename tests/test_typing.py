"""The package's types as a user's checker sees them: ``tests/typed_example.py`` passes mypy,
and a batch is not ``Any`` (a wrong annotation of it is an error)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mypy")


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    # the project's [tool.mypy] settings (pyproject.toml); paths given override its ``files``
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_typed_example_passes() -> None:
    got = _mypy("tests/typed_example.py")
    assert got.returncode == 0, got.stdout + got.stderr


def test_a_batch_is_not_any(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.py"
    wrong.write_text("import insitubatch_nodes as ib\n\n\n"
                     "def f(loader: ib.InSituLoader) -> None:\n"
                     "    batch: int = next(iter(loader))\n")
    got = _mypy(str(wrong))
    assert got.returncode == 1, got.stdout + got.stderr
    assert 'has type "dict[str, Tensor]"' in got.stdout, got.stdout


def test_type_checkers_see_every_export() -> None:
    """The names ``__init__`` imports lazily (``_EXPORTS``) are the ones it imports for type
    checkers (``if TYPE_CHECKING``), from the same modules."""
    tree = ast.parse((ROOT / "insitubatch_nodes" / "__init__.py").read_text())
    exports: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            exports = ast.literal_eval(node.value)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                typed.update({a.name: "." * imp.level + (imp.module or "") for a in imp.names})
    assert exports and typed == exports
