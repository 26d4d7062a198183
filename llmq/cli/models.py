"""`llmq models`: the built-in models."""

from __future__ import annotations

from rich.table import Table

from llmq.cli.console import out_console, print_json
from llmq.cli.options import JsonFlag


def models(
    json_out: JsonFlag = False,
) -> None:
    """List the built-in models.

    Their names work wherever a MODEL folder is expected.
    """
    from llmq.api import list_models

    rows = list_models()
    if json_out:
        print_json(rows)
        return
    table = Table(title="built-in models")
    for column in ("name", "description", "cached"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], row["description"], "yes" if row["cached"] else "no")
    out_console.print(table)
