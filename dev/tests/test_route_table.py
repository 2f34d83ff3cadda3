"""``dev/aadet_dev/route_table.py`` / ``dev/route_table.py``: the CUDA route table from sweep rows
(per family, precision and map size the fastest route among those finite and exact at every shape
of the class; the conv and the stem are no routes), and the committed table is what the committed
runs give."""
import json
import os
import subprocess
import sys

from aadet_dev.route_table import NOISE_MARGIN, build_route_table

from tests.helpers import REPO


def _row(key, route, ms, *, ok=True, family="aa", precision="bf16", hw=(40, 40)):
    return {"key": key, "family": family, "route": route, "precision": precision, "output": [64, *hw],
            "ok": ok, "time_s": ms / 1e3}


def _table(rows):
    return build_route_table(rows, capability="9.0", device_name="Some GPU", source="docs/runs/gpu/x")


def test_the_fastest_route_over_every_shape_of_the_class():
    rows = [
        _row("A", "fused", 5), _row("A", "triton", 4), _row("A", "conv3x3", 1),
        _row("B", "fused", 5), _row("B", "triton", 7),  # triton: 11 ms over both, fused 10
        _row("C", "fused", 9, hw=(80, 80)), _row("C", "triton", 3, hw=(80, 80)),
        _row("C", "fused", 2, hw=(80, 80), precision="fp32"), _row("C", "triton", 3, hw=(80, 80), precision="fp32"),
        _row("S", "stem_route", 1, family="stem"),
    ]
    entries = {(e["precision"], e["queries"]): e for e in _table(rows)["entries"]}
    assert set(entries) == {("bf16", 1600), ("bf16", 6400), ("fp32", 6400)}
    assert entries["bf16", 1600]["route"] == "fused" and entries["bf16", 1600]["shapes"] == 2
    assert entries["bf16", 1600]["times_ms"] == {"fused": 10.0, "triton": 11.0}
    assert entries["bf16", 6400]["route"] == "triton" and entries["fp32", 6400]["route"] == "fused"
    assert all(e["capability"] == "9.0" and e["family"] == "aa" for e in entries.values())


def test_the_default_stays_unless_another_route_beats_it_by_more_than_the_noise():
    def chosen(triton_ms, family="aa", default="fused"):
        rows = [_row("A", default, 10, family=family), _row("A", "triton", triton_ms, family=family)]
        return _table(rows)["entries"][0]["route"]

    margin_ms = 10 / (1 + NOISE_MARGIN)
    assert chosen(margin_ms + 0.05) == "fused" and chosen(margin_ms - 0.05) == "triton"
    assert chosen(9.9, family="sasa") == "fused" and chosen(5, family="sasa") == "triton"
    assert chosen(9.9, family="newfamily") == "triton"  # no default: the fastest


def test_a_route_wrong_or_not_finite_at_one_shape_is_not_counted():
    rows = [_row("A", "fused", 5), _row("A", "triton", 1, ok=False), _row("B", "fused", 5), _row("B", "triton", 1)]
    (entry,) = _table(rows)["entries"]
    assert entry["route"] == "fused" and entry["times_ms"] == {"fused": 10.0}
    assert _table([_row("A", "fused", 5, ok=False)])["entries"] == []


def test_the_committed_table_is_what_the_committed_runs_give():
    with open(os.path.join(REPO, "aadet", "layers", "functional", "route_table_cuda.json")) as f:
        made = json.load(f)["runs"]
    runs = [r["source"] for r in made]
    given = [r["capability"] for r in made if not r["capability_recorded"]]
    args = [*runs, *(["--capability", given[0]] if given else []), "--check"]
    r = subprocess.run([sys.executable, os.path.join(REPO, "dev", "route_table.py"), *args], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
