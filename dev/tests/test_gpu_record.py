"""``dev/aadet_dev/gpu_record.py`` on made-up records: a missing precision shows as not measured,
the newest record is the one rendered, its stages must be of its commit. (The committed record
rendered: ``dev/tests/test_generated_docs.py``, the one test file that reads the committed docs.)"""
import json
import os

import pytest

from aadet_dev import gpu_record
from aadet_dev.gpu_report import benchmarks_cuda

from tests.helpers import markdown_row


AA = "aa_retinanet_R_50_FPN_scratch_150ep"
CONV = "retinanet_R_50_FPN_scratch_150ep"


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
    assert markdown_row(text, f"`{AA}`", "fp32")[3] == "1.20x"
    assert markdown_row(text, f"`{AA}`", "bf16")[2:] == ["–"] * 6 + ["**not measured**"]
    # without bf16 the run is short of the targets' protocol: its fp32 value is shown, not judged
    target = "AA-R50 RetinaNet train time"
    assert markdown_row(text, target, f"`{AA}`", "fp32")[3:] == ["1.20x", "<= 1.10x", "not comparable"]
    assert markdown_row(text, target, f"`{AA}`", "bf16")[3:] == ["–", "<= 1.10x", "not measured"]
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


def test_the_configs_stage_shows_each_finite_runs_step_and_its_ratio_to_the_conv_r50():
    rows = [dict(config=CONV, precision="fp32", status="ok", step_ms=112.0),
            dict(config=AA, precision="fp32", status="ok", step_ms=191.0),
            dict(config=CONV, precision="bf16", status="failed",
                 error="FloatingPointError: iteration 1: non-finite gradients in [x]"),
            dict(config=AA, precision="bf16", status="ok", step_ms=180.0),
            dict(config="older", precision="fp32", status="ok")]  # a record made before steps were timed
    text = "".join(gpu_record._configs_section(dict(status="failed", results=rows, iters=20)))
    assert markdown_row(text, f"`{AA}`")[1:] == ["finite, 191 ms (1.71x)", "finite, 180 ms"]  # no bf16 base
    assert markdown_row(text, f"`{CONV}`")[1:] == ["finite, 112 ms (1.00x)",
                                                     "**not finite**: non-finite gradients at iteration 1"]
    assert markdown_row(text, "`older`")[1] == "finite"
