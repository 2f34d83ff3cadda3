"""The model table's rendering (``dev/aadet_dev/model_table.py``) on made-up rows and results:
the README summary's cells, splicing it into a document, and the errors for a document without
the table's markers."""
import pytest

from aadet_dev.model_table import (
    MARKDOWN_COMMAND,
    SUMMARY_BEGIN,
    SUMMARY_END,
    TABLE_END,
    parse_markdown,
    render_markdown,
    render_summary,
    splice_summary,
)


def test_parse_markdown_errors():
    with pytest.raises(ValueError, match="model-table:begin"):
        parse_markdown("no table here")


def test_summary_cells_show_the_spread_over_seeds():
    table = render_markdown([], MARKDOWN_COMMAND).replace(
        "\n\n" + TABLE_END,
        "\n| `Demo/x` | 448 | 1.00 | a | 5.0 | b | – | – | – | – | – | 1.0 (2.0) |\n\n" + TABLE_END)
    stats = {"mean": 20.0, "min": 18.0, "max": 22.0}
    demo = {"x": {"seeds": [42, 7], "trees_test": {"AP50": stats, "n": 2},
                  "trees_val": {"AP50": dict(stats, mean=30.0), "n": 2}}}
    rows = [ln for ln in render_summary(table, demo).splitlines() if ln.startswith("| `")]
    assert rows == ["| `Demo/x` | 1.00 | 5.0 | – | 2 | 30.0 (18.0–22.0) | 20.0 (18.0–22.0) |"]
    readme = f"# r\n{SUMMARY_BEGIN}\nold\n{SUMMARY_END}\ntail\n"
    assert splice_summary(readme, table, {}).endswith(f"{SUMMARY_END}\ntail\n")
    with pytest.raises(ValueError, match="model-summary:begin"):
        splice_summary("# r\n", table, {})
