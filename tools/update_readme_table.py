#!/usr/bin/env python
"""Write the README's results table (between the model-summary markers) from docs/model_table.md
and docs/demo_results.json (`make docs` runs it after regenerating the table with
tools/analyze_model.py; tools/record_demo_results.py does the same after recording runs)."""
import os

from aadet.analysis.model_table import load_demo_results, splice_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    with open(os.path.join(REPO, "docs", "model_table.md")) as f:
        table = f.read()
    demo = load_demo_results(os.path.join(REPO, "docs", "demo_results.json"))
    path = os.path.join(REPO, "README.md")
    with open(path) as f:
        readme = f.read()
    with open(path, "w") as f:
        f.write(splice_summary(readme, table, demo))
    print(f"updated {path}")
