#!/usr/bin/env python
"""Copy docs/model_table.md between the README's model-table markers (`make docs` runs it after
regenerating the table with tools/analyze_model.py)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- model-table:begin -->", "<!-- model-table:end -->"


def splice(readme: str, table: str) -> str:
    block = table[table.index(BEGIN): table.index(END) + len(END)]
    return readme[: readme.index(BEGIN)] + block + readme[readme.index(END) + len(END):]


if __name__ == "__main__":
    with open(os.path.join(REPO, "docs", "model_table.md")) as f:
        table = f.read()
    path = os.path.join(REPO, "README.md")
    with open(path) as f:
        readme = f.read()
    with open(path, "w") as f:
        f.write(splice(readme, table))
    print(f"updated {path}")
