"""The string constants a Python source holds, docstrings aside: how the tests that check
variable names tell a name the code reads (``os.environ.get("X")``) from one it only documents."""

from __future__ import annotations

import ast

_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def string_constants(text: str, filename: str = "<unknown>") -> set[str]:
    """Every ``str`` constant in ``text`` that is not the docstring of its module, class or function."""
    tree = ast.parse(text, filename=filename)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, _DEFINITIONS)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }
