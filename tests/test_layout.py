"""The repository's shape as README's Layout draws it, and the 500-line limit on its text files."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# tracked files that are data, not text a reader follows: images, the tokenizer corpus of the tiny model
NOT_TEXT = (".png", ".jpg", ".gz", ".xz")
DATA_FILES = {"alfrl/assets/alfworld_corpus.txt"}


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in block.splitlines() if line.startswith("    "))


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def test_every_module_is_in_the_layout_and_every_named_module_exists():
    block = layout_block()
    named = set(re.findall(r"\b([a-z_]+\.py)\b", block))
    modules = {p.name for p in (ROOT / "alfrl").glob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - named)
    assert not missing, f"alfrl modules not in README's Layout: {missing}"
    stale = sorted(n for n in named if not any(ROOT.glob(f"*/{n}")) and not any(ROOT.glob(f"*/*/{n}")))
    assert not stale, f"README's Layout names files that do not exist: {stale}"
    for folder in re.findall(r"^    ([a-z_]+)/", block, flags=re.M):
        assert (ROOT / folder).is_dir(), f"README's Layout names {folder}/, which does not exist"


ACROSS_MODULES = {"test_eval.py", "test_recipes.py", "test_train.py", "test_ddp.py", "test_faults.py", "test_stepwise.py", "test_layout.py"}
"""Test files named after no single module (docs/layout.md says what each covers)."""


def test_test_files_mirror_the_modules():
    # tests/test_X.py tests alfrl/X.py or callbacks/X.py: a reader changing a module finds its tests by its name
    modules = {p.stem for folder in ("alfrl", "callbacks") for p in (ROOT / folder).glob("*.py")}
    strays = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                    if p.stem.removeprefix("test_") not in modules and p.name not in ACROSS_MODULES)
    assert not strays, f"tests named after no module: {strays}: name them test_<module>.py, or list them in ACROSS_MODULES and docs/layout.md"
    layout = (ROOT / "docs" / "layout.md").read_text()
    assert all(name in layout for name in ACROSS_MODULES), "docs/layout.md names every test file that covers several modules"


def test_callbacks_hold_only_callback_classes():
    for path in (ROOT / "callbacks").glob("*.py"):
        tops = re.findall(r"^(def|class) (\w+)", path.read_text(), flags=re.M)
        functions = [name for kind, name in tops if kind == "def"]
        assert not functions, f"{path.name}: library functions belong in alfrl/, not callbacks/: {functions}"


def code_lines(text: str) -> int:
    """Lines of a Python file that hold code: not blank, not only a comment, not part of a docstring (a string that is a
    statement of its own)."""
    import ast

    doc = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, node.end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1)
               if i not in doc and line.strip() and not line.strip().startswith("#"))


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    text = '''"""Module.

two lines."""
import os  # a comment


def f():
    """Doc."""
    x = "not a docstring"
    # a comment
    return x
'''
    assert code_lines(text) == 4


def test_no_file_is_over_500_lines():
    """Python files by their code lines (docstrings and comments are free), other text files by all their lines."""
    long = []
    for f in tracked_files():
        if f.endswith(NOT_TEXT) or f in DATA_FILES or f.startswith("results/"):
            continue  # raw measured outputs are kept as they came back
        try:
            text = (ROOT / f).read_text()
        except UnicodeDecodeError:
            continue
        n = code_lines(text) if f.endswith(".py") else text.count("\n")
        if n > 500:
            long.append(f"{f} ({n})")
    assert not long, f"files over 500 lines: {long}"
