"""Command-line value parsers shared by the tools and the reports runner."""

from __future__ import annotations

import ast


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def option(text: str) -> tuple[str, object]:
    """KEY=VALUE from the command line; VALUE as a Python literal where it parses, else the string."""
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value
