"""``dev/aadet_dev/gpu_record.py``: the committed GPU run record (``docs/runs/gpu/35bbeff-h200``)
rendered with the ratios its raw benchmark output gives (computed here from that JSON, not from
the renderer), its failed and cut-off cases named; a made-up record missing a precision shows it
as not measured."""
import json
import os

import pytest

from aadet_dev import gpu_record
from aadet_dev.gpu_report import benchmarks_cuda

from tests.helpers import REPO

RECORD = os.path.join(REPO, "docs", "runs", "gpu", "35bbeff-h200")
AA = "aa_retinanet_R_50_FPN_scratch_150ep"
CONV = "retinanet_R_50_FPN_scratch_150ep"
SASA = "sasa_convstem_retinanet_R_50_FPN_scratch_150ep"
SASA_FULL = "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"


def _row(markdown: str, *first: str) -> list:
    """The cells of the one table row whose first cells are ``first``."""
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in markdown.splitlines()
            if line.startswith("| ")]
    rows = [r for r in rows if r[:len(first)] == list(first)]
    assert len(rows) == 1, (first, rows)
    return rows[0]


@pytest.fixture(scope="module")
def record():
    return gpu_record.load_record(RECORD, REPO)


@pytest.fixture(scope="module")
def raw():
    """tools/benchmark.py's own output of the first call: {(config, precision): result}."""
    with open(os.path.join(RECORD, "first_work_bench_configs.json")) as f:
        results = json.load(f)["results"]
    return {(os.path.basename(r["config"])[:-5], "bf16" if r["amp"] else "fp32"): r for r in results}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_committed_record_gives_the_raw_ratios(record, raw, precision):
    """AA-R50's and the SASA backbone's rows: train step, inference and train peak memory over the
    conv R50's of the same run and precision, from the medians and peaks benchmark.py wrote."""
    text = gpu_record.render_record(record)
    base = raw[(CONV, precision)]
    cases = [AA] + ([SASA] if precision == "bf16" else [])
    for config in cases:
        r = raw[(config, precision)]
        expected = [f"{r[phase][key] / base[phase][key]:.2f}x"
                    for phase, key in (("train", "median_s"), ("inference", "median_s"), ("train", "peak_bytes"))]
        cells = _row(text, f"`{config}`", precision)
        assert [cells[3], cells[5], cells[7]] == expected, (config, precision, cells)
        assert cells[2] == f"{1e3 * r['train']['median_s']:.1f}"
    headline = gpu_record.render_headline(record)
    train = raw[(AA, precision)]["train"]["median_s"] / base["train"]["median_s"]
    assert f"{train:.2f}x ({precision})" in headline


def test_committed_record_names_the_failed_and_cut_off_cases(record):
    text = gpu_record.render_record(record)
    for config in (SASA, SASA_FULL):  # both SASA R50s in fp32: NaN at the first iteration
        assert _row(text, f"`{config}`", "fp32")[-1] == "**NaN loss at iteration 0**"
    assert _row(text, f"`{SASA_FULL}`", "bf16")[-1] == "**cut off**"  # the stage's time ran out
    assert "tools/benchmark.py exit timeout after 7 finished case(s)" in text
    assert "the SASA layer (its targets) cut off in fp32 and bf16" in text
    assert _row(text, "SASA attention-backbone RetinaNet train time", f"`{SASA}`", "fp32")[-1] == \
        "not measured: NaN loss at iteration 0"
    assert _row(text, "SASA all-attention RetinaNet train time", f"`{SASA_FULL}`", "bf16")[-1] == \
        "not measured: cut off"
    for precision in ("fp32", "bf16"):  # the SASA layer's targets: its suite was cut off
        for what in ("time", "memory"):
            target = f"LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd {what} vs 3x3 conv"
            assert _row(text, target, "`sasa_*_80`", precision)[-1] == "not measured: cut off"
    # the configs stage: which config x precision ran finite, which did not, which timed out
    configs = "sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"
    assert _row(text, f"`{configs}`", "**not finite**: non-finite gradients at iteration 2")[-1] == "finite"
    assert _row(text, "`trees_SASA_R_26_slim_FPN`", "**timed out**")[-1] == "**timed out**"
    assert "29 of 34 config x precision runs finite" in text
    headline = gpu_record.render_headline(record)
    assert "NaN loss at iteration 0 in fp32" in headline and "did not finish" in headline
    assert "NVIDIA H200" in text and "Triton 3.6.0" in text and "`35bbeff`" in text
    assert "AADET_LOAN_SECONDS=550 bash tools/gpu_loan.sh first $OUT" in text


# ----------------------------------------------------------------------------- a made-up record
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ENV = {"device": "cuda", "device_name": "Some GPU", "torch": "9.0", "cuda": "99.0", "triton": "9.9",
       "driver": "1.2.3, 1000 MiB", "python": "3.12", "detectron2": "0.7.2 (/somewhere)"}


def _fp32_only_record(folder, commit=COMMIT, date="2030-01-01"):
    """A record whose benchmarks stage measured the conv R50 and AA-R50 in fp32 only."""
    results = [dict(config=f"configs/COCO-Detection/{c}.yaml", amp=False, env=ENV,
                    train={"median_s": t, "peak_bytes": m * 2**20}, inference={"median_s": t / 2})
               for c, t, m in ((CONV, 0.100, 1000), (AA, 0.120, 1100))]
    bench = benchmarks_cuda([dict(device="cuda", size=[640, 640], batch=8, iters=10, warmup=3, env=ENV,
                                  baseline=f"configs/COCO-Detection/{CONV}.yaml", results=results)])
    stage = dict(status="failed", benchmarks=bench, device="cuda", commit=commit, dirty=False, env=ENV,
                 elapsed_s=100.0, budget_s=200.0)
    os.makedirs(folder)
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump({"status": "failed", "stages": {"benchmarks": stage}}, f)
    with open(os.path.join(folder, "record.json"), "w") as f:
        json.dump({"commit": COMMIT, "date": date, "machine": "a test", "prepare": "true",
                   "calls": [{"name": "only", "command": "make gpu-check", "report": "report.json"}]}, f)
    return str(folder)


def test_a_missing_precision_is_not_measured(tmp_path):
    record = gpu_record.load_record(_fp32_only_record(tmp_path / "r"), str(tmp_path))
    text = gpu_record.render_record(record)
    assert _row(text, f"`{AA}`", "fp32")[3] == "1.20x"
    assert _row(text, f"`{AA}`", "bf16")[2:] == ["–"] * 6 + ["**not measured**"]
    # without bf16 the run is short of the targets' protocol: its fp32 value is shown, not judged
    assert _row(text, "AA-R50 RetinaNet train time", f"`{AA}`", "fp32")[3:] == ["1.20x", "<= 1.10x", "not comparable"]
    assert _row(text, "AA-R50 RetinaNet train time", f"`{AA}`", "bf16")[3:] == ["–", "<= 1.10x", "not measured"]
    assert "Not comparable with the targets: no bf16 measurement" in text
    headline = gpu_record.render_headline(record)
    assert "AA-R50 1.20x (fp32), not measured in bf16" in headline and "targets not judged" in headline


def test_the_newest_record_is_rendered_and_stages_must_be_of_its_commit(tmp_path):
    _fp32_only_record(tmp_path / "old", date="2029-12-31")
    _fp32_only_record(tmp_path / "new")
    assert gpu_record.latest_record(str(tmp_path)) == str(tmp_path / "new")
    assert gpu_record.latest_record(str(tmp_path / "none")) is None
    with pytest.raises(ValueError, match="ran at commit"):
        gpu_record.load_record(_fp32_only_record(tmp_path / "other", commit="f" * 40))
