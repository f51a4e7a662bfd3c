"""No class of the package outgrows one reader's view: at most 450 lines each."""

from __future__ import annotations

import ast
from pathlib import Path

import mmcache

LIMIT = 450


def test_every_class_is_at_most_450_lines() -> None:
    root = Path(mmcache.__file__).parent
    sizes = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                where = f"{path.relative_to(root)}:{node.name}"
                sizes[where] = node.end_lineno - node.lineno + 1
    assert len(sizes) > 50  # the walk found the package's classes
    too_long = {where: n for where, n in sizes.items() if n > LIMIT}
    assert not too_long, f"split these classes (at most {LIMIT} lines): {too_long}"
