"""Terminal tables: drawn with ``rich`` when the stream is a terminal and rich is
installed (transformers brings it in), else plain aligned text with no colour codes, so
logs and pipes stay clean (``NO_COLOR`` is honoured too)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO


def _use_rich(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, left aligned; newlines in cells become spaces."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c).replace("\n", " ") for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None,
                stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    if _use_rich(stream):
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_lines=False)
        for header in headers:
            table.add_column(str(header), overflow="fold")
        for row in rows:
            table.add_row(*("" if c is None else str(c) for c in row))
        Console(file=stream).print(table)
        return
    if title:
        print(title, file=stream)
    print(plain_table(headers, rows), file=stream, flush=True)
