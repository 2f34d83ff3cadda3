"""``dev/gpu_check.py`` and ``dev/aadet_dev/gpu_report.py`` on CPU: the benchmark JSON ->
``benchmarks_cuda.json`` conversion with its target verdicts (synthetic benchmark outputs with
known numbers) and a smoke run's lack of them, the junit parser and the ``tests`` stage's verdict
(a skipped CUDA test fails it), the stage merge and its refusal of stage files of another
commit, the demo metrics of two test datasets, the configs stage's ``--device cpu`` dry run on
one tiny config, and that no CUDA test of the suite hides from ``pytest -m cuda``."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from aadet_dev import gpu_report as gr

from tests.helpers import REPO, load_dev

MIB = 2**20
ENV = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0"}
BASE, AA, SASA, FULL, HALO = (f"configs/COCO-Detection/{n}.yaml" for n in (
    "retinanet_R_50_FPN_scratch_150ep", "aa_retinanet_R_50_FPN_scratch_150ep",
    "sasa_convstem_retinanet_R_50_FPN_scratch_150ep",
    "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep", "halo_retinanet_R_50_FPN_scratch_150ep"))


def _case(config, amp, train_s, infer_s, train_mib, **extra):
    return dict(config=config, amp=amp, params=1, env=ENV,
                train={"median_s": train_s, "peak_bytes": int(train_mib * MIB)},
                inference={"median_s": infer_s, "peak_bytes": 123}, **extra)


def config_report(**top):
    """What ``tools/benchmark.py --amp both --amp-dtype bfloat16`` writes (the keys gpu_report reads)."""
    results = [
        # fp32: AA 1.05x train (pass), 1.41x infer (miss by 0.11), 1.10x memory (pass)
        _case(BASE, False, 0.200, 0.100, 1000), _case(AA, False, 0.210, 0.141, 1100),
        _case(SASA, False, 0.280, 0.150, 1500), _case(FULL, False, 0.500, 0.300, 2000),
        _case(HALO, False, 0.280, 0.150, 1400),  # HaloNet 1.40x (miss)
        # bf16: AA 1.20x train (miss), SASA 1.5x exactly (pass: <= is inclusive), HaloNet 1.3x (pass),
        # FULL fails (OOM)
        _case(BASE, True, 0.100, 0.050, 600), _case(AA, True, 0.120, 0.050, 690),
        _case(SASA, True, 0.150, 0.070, 800), _case(HALO, True, 0.130, 0.070, 800),
        dict(config=FULL, amp=True, error="CUDA out of memory: tried to allocate 2 GiB"),
    ]
    return dict(dict(device="cuda", size=[640, 640], batch=8, warmup=5, iters=20, baseline=BASE, opts=[],
                     env=ENV, results=results), **top)


def layer_report(amp, conv_s, fused_s, conv_bytes, fused_bytes, amp_dtype="bfloat16", suite="sasa"):
    """What ``dev/benchmark_layers.py --suite sasa --sizes 80 [--amp --amp-dtype bfloat16]`` writes
    (``suite="halo"``: the HaloNet suite's CUDA cases)."""
    others = {"sasa": (("neighborhood", 4 * conv_s, 3 * conv_bytes), ("fused", fused_s, fused_bytes),
                       ("unfold", 9 * conv_s, 40 * conv_bytes)),
              "halo": (("fused", fused_s, fused_bytes), ("materialized", 3 * conv_s, 6 * conv_bytes),
                       ("sasa", 4 * conv_s, 3 * conv_bytes))}[suite]
    rows = [dict(suite=suite, kind="layer", impl=impl, side=80, channels=256, median_s=t, cpu_median_s=t,
                 peak_bytes=m, peak_abs_bytes=m, peak_exact=True)
            for impl, t, m in others + (("conv3x3", conv_s, conv_bytes),)]
    out = dict(device="cuda", batch=8, warmup=5, iters=20, amp=amp, env=ENV, reference_check={}, results=rows)
    if amp:
        out["amp_dtype"] = amp_dtype
    return out


def _one(rows, **key):
    hits = [r for r in rows if all(r[k] == v for k, v in key.items())]
    assert len(hits) == 1, (key, hits)
    return hits[0]


# ----------------------------------------------------------------------------- conversion
def test_config_rows_values_and_ratios_to_the_same_precision_baseline():
    rows = gr.config_rows(config_report(), amp_dtype="bfloat16")
    assert len(rows) == 10
    aa32 = _one(rows, config="aa_retinanet_R_50_FPN_scratch_150ep", precision="fp32")
    assert aa32["train_ms"] == pytest.approx(210.0) and aa32["infer_ms"] == pytest.approx(141.0)
    assert aa32["train_peak_mib"] == pytest.approx(1100.0)
    assert aa32["train_ms_ratio"] == pytest.approx(1.05)
    assert aa32["infer_ms_ratio"] == pytest.approx(1.41)
    assert aa32["train_peak_mib_ratio"] == pytest.approx(1.10)
    aa16 = _one(rows, config="aa_retinanet_R_50_FPN_scratch_150ep", precision="bf16")
    # bf16 ratios use the bf16 baseline (0.100 s), not the fp32 one (0.200 s)
    assert aa16["train_ms_ratio"] == pytest.approx(1.20)
    assert aa16["train_peak_mib_ratio"] == pytest.approx(1.15)
    base = _one(rows, config="retinanet_R_50_FPN_scratch_150ep", precision="bf16")
    assert base["train_ms_ratio"] == base["infer_ms_ratio"] == pytest.approx(1.0)
    full = _one(rows, config="sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep", precision="bf16")
    assert full["train_ms"] is None and full["train_ms_ratio"] is None and "out of memory" in full["error"]


def test_amp_dtype_comes_from_the_json_first_and_is_required():
    rows = gr.config_rows(config_report(amp_dtype="float16"), amp_dtype="bfloat16")
    assert {r["precision"] for r in rows} == {"fp32", "fp16"}
    with pytest.raises(ValueError, match="amp_dtype"):
        gr.config_rows(config_report())  # AMP results whose dtype nobody states
    with pytest.raises(ValueError, match="unknown amp_dtype"):
        gr.precision_name(True, "int8")


def test_layer_rows_ratios_to_the_3x3_conv():
    rows = gr.layer_rows(layer_report(False, 0.002, 0.005, 100 * MIB, 150 * MIB))
    assert [r["layer"] for r in rows] == ["sasa_neighborhood_80", "sasa_fused_80", "sasa_unfold_80",
                                          "sasa_conv3x3_80"]
    fused = _one(rows, impl="fused")
    assert fused["precision"] == "fp32" and fused["side"] == 80 and fused["channels"] == 256
    assert fused["train_ms"] == pytest.approx(5.0) and fused["train_peak_mib"] == pytest.approx(150.0)
    assert fused["train_ms_ratio"] == pytest.approx(2.5) and fused["train_peak_mib_ratio"] == pytest.approx(1.5)
    assert _one(rows, impl="conv3x3")["train_ms_ratio"] == 1.0
    assert gr.layer_rows(layer_report(True, 0.001, 0.0015, 50, 60))[0]["precision"] == "bf16"


def test_benchmarks_cuda_schema_and_target_verdicts():
    bench = gr.benchmarks_cuda(
        [config_report()],
        [layer_report(False, 0.002, 0.005, 100 * MIB, 150 * MIB), layer_report(True, 0.001, 0.0015, 50, 60)],
        amp_dtype="bfloat16",
    )
    assert bench["schema"] == gr.SCHEMA_VERSION and bench["device_name"] == "NVIDIA H100 80GB HBM3"
    assert bench["size"] == [640, 640] and bench["batch"] == 8 and bench["layer_batch"] == 8
    assert bench["baseline"] == "retinanet_R_50_FPN_scratch_150ep"
    for row in bench["configs"]:
        assert {"train_ms", "infer_ms", "train_peak_mib", "train_ms_ratio", "infer_ms_ratio",
                "train_peak_mib_ratio"} <= set(row)
    t = {(v["target"], v["subject"], v["precision"]): v for v in bench["targets"]}
    aa = "aa_retinanet_R_50_FPN_scratch_150ep"
    assert t[("AA-R50 RetinaNet train time", aa, "fp32")]["status"] == "pass"
    miss = t[("AA-R50 RetinaNet inference time", aa, "fp32")]
    assert miss["status"] == "miss" and miss["value"] == pytest.approx(1.41)
    assert miss["excess"] == pytest.approx(0.11) and miss["excess_pct"] == pytest.approx(100 * 0.11 / 1.3)
    assert t[("AA-R50 RetinaNet train time", aa, "bf16")]["status"] == "miss"  # 1.20 > 1.10
    assert t[("AA-R50 RetinaNet train time, first step", aa, "bf16")]["status"] == "pass"  # 1.20 <= 1.25
    assert t[("AA-R50 RetinaNet train memory", aa, "bf16")]["status"] == "pass"  # 1.15 <= 1.30
    halo = "halo_retinanet_R_50_FPN_scratch_150ep"
    assert t[("HaloNet R50 RetinaNet train time", halo, "bf16")]["status"] == "pass"
    assert t[("HaloNet R50 RetinaNet train time", halo, "fp32")]["status"] == "miss"
    sasa = t[("SASA attention-backbone RetinaNet train time", "sasa_convstem_retinanet_R_50_FPN_scratch_150ep",
              "bf16")]
    assert sasa["status"] == "pass" and sasa["value"] == pytest.approx(1.5)
    full = "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep"
    oom = t[("SASA all-attention RetinaNet train time", full, "bf16")]
    assert oom["status"] == "missing" and "out of memory" in oom["note"]
    # layers: every route of the SASA layer at 80x80 gets its verdict, the 3x3 conv itself none
    layer_time = {k[1]: v for k, v in t.items() if k[0].endswith("fwd+bwd time vs 3x3 conv") and k[2] == "fp32"}
    assert set(layer_time) == {"sasa_neighborhood_80", "sasa_fused_80", "sasa_unfold_80"}
    assert layer_time["sasa_fused_80"]["status"] == "miss"
    assert layer_time["sasa_fused_80"]["excess_pct"] == pytest.approx(150.0)  # 2.5x against 1.0x
    bf16_mem = t[("LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd memory vs 3x3 conv", "sasa_fused_80", "bf16")]
    assert bf16_mem["status"] == "pass" and bf16_mem["value"] == pytest.approx(1.2)
    json.dumps(bench)  # machine-readable as is
    md = gr.render_benchmarks_markdown(bench)
    assert "NVIDIA H100 80GB HBM3" in md and "**miss** by 0.11 (+8%)" in md and "not measured" in md


def test_all_attention_fp32_ratio_is_the_measured_one():
    rows = gr.config_rows(config_report(), amp_dtype="bfloat16")
    full = _one(rows, config="sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep", precision="fp32")
    assert full["train_ms_ratio"] == pytest.approx(2.5)
    verdicts = gr.evaluate_targets(rows, [])
    v = _one(verdicts, target="SASA all-attention RetinaNet train time", precision="fp32")
    assert v["status"] == "miss" and v["excess"] == pytest.approx(0.5) and v["excess_pct"] == pytest.approx(25.0)


def test_a_target_without_its_subject_is_missing_not_passed():
    rows = [r for r in gr.config_rows(config_report(), amp_dtype="bfloat16") if not r["config"].startswith("aa_")]
    verdicts = gr.evaluate_targets(rows, [])
    aa = [v for v in verdicts if v["target"].startswith("AA-R50")]
    assert len(aa) == 8 and all(v["status"] == "missing" and v["note"] == "not measured" for v in aa)  # 4 x 2


def test_reports_of_different_devices_or_sizes_are_refused():
    other = config_report()
    other["env"] = dict(ENV, device_name="NVIDIA A100")
    with pytest.raises(ValueError, match="different devices"):
        gr.benchmarks_cuda([config_report(), other], amp_dtype="bfloat16")
    with pytest.raises(ValueError, match="differ in size"):
        gr.benchmarks_cuda([config_report(), dict(config_report(), size=[320, 320])], amp_dtype="bfloat16")
    with pytest.raises(ValueError, match="at least one"):
        gr.benchmarks_cuda([], [])


def test_benchmark_configs_and_targets_name_real_configs():
    for path in gr.BENCHMARK_CONFIGS:
        assert os.path.isfile(os.path.join(REPO, path)), path
    names = {gr.config_name(p) for p in gr.BENCHMARK_CONFIGS}
    for t in gr.TARGETS:
        assert t.section in ("configs", "layers")
        if t.section == "configs":
            assert t.subject in names, t
    assert gr.config_name(gr.BASELINE_CONFIG) not in {t.subject for t in gr.TARGETS}


# ----------------------------------------------------------------------------- junit and merge
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1"
 skipped="1" tests="5" time="12.5"><testcase classname="tests.test_cuda" name="test_a[fp32]" time="1"/>
<testcase classname="tests.test_cuda" name="test_a[bf16]" time="1"><failure message="AssertionError: err 0.3 &gt; 0.05">
trace</failure></testcase><testcase classname="tests.test_cuda" name="test_b" time="1"/>
<testcase classname="tests.test_cuda" name="test_c" time="0"><skipped message="needs CUDA"/></testcase>
<testcase classname="tests.test_cuda" name="test_d" time="0"><error message="fixture 'x' not found"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit_counts_and_messages():
    j = gr.parse_junit(JUNIT)
    assert (j["tests"], j["passed"], j["failed"], j["errors"], j["skipped"]) == (5, 2, 1, 1, 1)
    assert j["time_s"] == pytest.approx(12.5)
    assert j["failures"] == [
        {"test": "tests.test_cuda::test_a[bf16]", "kind": "failed", "message": "AssertionError: err 0.3 > 0.05"},
        {"test": "tests.test_cuda::test_d", "kind": "errors", "message": "fixture 'x' not found"},
    ]
    assert j["skipped_reasons"] == {"needs CUDA": 1}
    assert j["skipped_tests"] == [{"test": "tests.test_cuda::test_c", "reason": "needs CUDA"}]


def test_merge_stage_results_status_and_markdown():
    env = dict(ENV, triton="3.6.0", driver="580.159.04, 81559 MiB")
    fresh = {"commit": HEAD, "dirty": False, "device": "cuda"}
    tests = dict(fresh, status="failed", junit=gr.parse_junit(JUNIT), env=env, elapsed_s=20, budget_s=300)
    merged = gr.merge_stage_results({"tests": tests}, head=HEAD)
    assert merged["status"] == "failed" and merged["stages"]["demo"] == {"status": "not run"}
    assert merged["envs"]["tests"]["triton"] == "3.6.0"
    md = gr.render_report_markdown(merged)
    assert "# aadet GPU check: failed" in md and "NVIDIA H100 80GB HBM3" in md and "580.159.04" in md
    assert "failed: `tests.test_cuda::test_a[bf16]`: AssertionError: err 0.3 > 0.05" in md
    assert gr.merge_stage_results({"tests": dict(tests, status="ok")}, head=HEAD)["status"] == "incomplete"
    assert gr.merge_stage_results({"tests": dict(tests, status="ok")}, head=HEAD, required=["tests"])["status"] == "ok"
    everything = {name: dict(fresh, status="ok") for name in gr.STAGES}
    assert gr.merge_stage_results(everything, head=HEAD)["status"] == "ok"
    # a stage that does not say where, at which commit and in which tree it ran proves nothing
    for field in ("device", "commit", "dirty"):
        unknown = dict(everything, tests={k: v for k, v in everything["tests"].items() if k != field})
        assert gr.merge_stage_results(unknown, head=HEAD)["status"] == "failed", field
    assert gr.merge_stage_results(everything)["status"] == "failed"  # no HEAD to compare with
    with pytest.raises(ValueError, match="unknown stage"):
        gr.merge_stage_results({"lint": {"status": "ok"}})


def junit_xml(*cases):
    """A pytest ``--junitxml`` file of ``(name, outcome)`` cases; outcome ``"passed"``,
    ``"failure"``, ``"error"`` or ``"skipped:<reason>"``."""
    body = []
    for name, outcome in cases:
        kind, _, msg = outcome.partition(":")
        inner = "" if kind == "passed" else f'<{kind} message="{msg or kind}"/>'
        body.append(f'<testcase classname="tests.test_cuda" name="{name}" time="1">{inner}</testcase>')
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" time="3">'
            + "".join(body) + "</testsuite></testsuites>")


def test_tests_stage_is_ok_only_when_every_cuda_test_ran_and_passed():
    ok = gr.parse_junit(junit_xml(("test_a", "passed"), ("test_b", "passed")))
    assert gr.tests_stage_result(ok, 0) == {"status": "ok"}
    # one pass and a skip, no failure: still a check that did not happen
    skipped = gr.parse_junit(junit_xml(("test_a", "passed"), ("test_b", "skipped:needs the triton package"),
                                       ("test_c", "skipped:needs the triton package")))
    v = gr.tests_stage_result(skipped, 0)
    assert v["status"] == "failed"
    assert "2 CUDA-marked test(s) skipped: needs the triton package (2)" in v["error"]
    failed = gr.parse_junit(junit_xml(("test_a", "passed"), ("test_b", "failure:AssertionError")))
    assert gr.tests_stage_result(failed, 1)["error"] == "1 failed, 0 errors"
    none = gr.parse_junit(junit_xml())
    assert gr.tests_stage_result(none, 5)["error"] == "no CUDA test ran (none collected)"
    assert gr.tests_stage_result(gr.parse_junit(junit_xml(("test_a", "passed"))), 3)["error"] == "pytest exit 3"
    assert "no junit XML (exit timeout)" in gr.tests_stage_result(None, "timeout")["error"]
    # the report lists every skip with its reason and test
    stage = dict(gr.tests_stage_result(skipped, 0), junit=skipped)
    md = gr.render_report_markdown(gr.merge_stage_results({"tests": stage}))
    assert "## tests: failed" in md and "- skipped (2): needs the triton package" in md
    assert "`tests.test_cuda::test_b`" in md and "`tests.test_cuda::test_c`" in md


def test_a_smoke_run_gets_no_target_verdict():
    small = dict(config_report(), size=[256, 256], batch=2)
    layers = [layer_report(False, 0.002, 0.005, 100 * MIB, 150 * MIB), layer_report(True, 0.001, 0.0015, 50, 60)]
    for layer in layers:
        layer["batch"] = 2
    for bench in (gr.benchmarks_cuda([small], layers, amp_dtype="bfloat16", smoke=True),
                  gr.benchmarks_cuda([small], layers, amp_dtype="bfloat16"),  # other sizes: the same
                  gr.benchmarks_cuda([config_report()], amp_dtype="bfloat16", smoke=True)):
        assert bench["comparable"] is False and "defined at 640x640, batch 8" in bench["not_comparable_why"]
        statuses = {t["status"] for t in bench["targets"]}
        assert statuses <= {"not comparable", "missing"} and "not comparable" in statuses
        assert all("excess" not in t for t in bench["targets"])
        md = gr.render_benchmarks_markdown(bench)
        assert md.startswith("**Smoke run, not comparable to targets**")
        verdicts = [line.rsplit("|", 3)[-3].strip() for line in md.splitlines() if line.startswith("| ")
                    and any(t["target"] in line for t in bench["targets"])]
        assert verdicts and all(v in (gr.NOT_COMPARABLE, "not measured") or v.startswith("not measured:")
                                for v in verdicts), verdicts
        assert "pass" not in md and "miss" not in md.replace("missing", "")
    assert "images 256x256, batch 2, layer batch 2" in gr.benchmarks_cuda(
        [small], layers, amp_dtype="bfloat16")["not_comparable_why"]
    full = gr.benchmarks_cuda([config_report()], amp_dtype="bfloat16")
    assert full["comparable"] is True and full["not_comparable_why"] is None
    # the report of a quick run says so in its title, and a smoke run never passes the check
    stage = {"status": "ok", "quick": True, "benchmarks": gr.benchmarks_cuda([small], layers, amp_dtype="bfloat16"),
             "commit": HEAD, "dirty": False, "device": "cuda"}
    report = gr.merge_stage_results({"benchmarks": stage}, head=HEAD, required=["benchmarks"])
    title = gr.render_report_markdown(report).splitlines()[0]
    assert title.startswith("# aadet GPU check: failed (") and gr.NOT_COMPARABLE in title
    assert "benchmarks: a --quick smoke run" in title and report["targets"]["status"] == "not comparable"


def test_stage_files_of_another_commit_are_refused_or_marked():
    head, old = "a" * 40, "b" * 40
    stages = {"tests": {"status": "ok", "commit": head, "dirty": False},
              "configs": {"status": "ok", "commit": old, "dirty": True},
              "demo": {"status": "ok"}}  # a file of before commits were recorded
    files = {"configs": "/x/stage_configs.json", "demo": "/x/stage_demo.json"}
    with pytest.raises(gr.StaleStageError) as e:
        gr.stale_stages(stages, head, files=files)
    msg = str(e.value)
    assert f"/x/stage_configs.json: ran at commit {old[:12]}, HEAD is {head[:12]}" in msg
    assert f"/x/stage_demo.json: ran at commit unknown, HEAD is {head[:12]}" in msg
    assert "stage_tests" not in msg and "--allow-stale" in msg
    with pytest.raises(gr.StaleStageError, match="HEAD is unknown"):  # no checkout to compare with
        gr.stale_stages({"tests": stages["tests"]}, None)
    assert gr.stale_stages({"tests": stages["tests"]}, head) == {}
    stale = gr.stale_stages(stages, head, allow_stale=True)
    assert stale == {"configs": {"commit": old, "dirty": True, "head": head},
                     "demo": {"commit": None, "dirty": None, "head": head}}
    report = gr.merge_stage_results(stages, head=head, stale=stale)
    assert report["stale_stages"] == ["configs", "demo"] and report["stages"]["configs"]["stale"]["commit"] == old
    assert "stale" not in report["stages"]["tests"] and "stale" not in stages["configs"]  # inputs untouched
    assert report["status"] == "failed"  # merged, never counted
    md = gr.render_report_markdown(report)
    assert "stale stages from another commit: configs, demo" in md.splitlines()[0]
    assert f"**Stale**: ran at commit {old[:12]}" in md and "uncommitted changes" in md


# ----------------------------------------------------------------------------- the tool
TINY = """_BASE_: "{base}"
MODEL:
  RESNETS:
    DEPTH: 18
    RES2_OUT_CHANNELS: 64
    NORM: "GN"
  FPN:
    OUT_CHANNELS: 32
"""


@pytest.fixture(scope="module")
def gpu_check():
    """``dev/gpu_check.py`` as a module (its ``main`` runs in this process; stage workers and
    tools still run in subprocesses)."""
    return load_dev("gpu_check")


def test_cpu_dry_run_of_the_configs_stage_goes_on_after_a_broken_config(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # main() prepends the checkout
    demo = os.path.join(REPO, "configs", "Demo")
    bad = tmp_path / "bad.yaml"  # fails validation when built: SASA's kernel must be odd
    bad.write_text(f'_BASE_: "{demo}/trees_SASA_R_26_slim_FPN.yaml"\nMODEL:\n  SASA:\n    KERNEL_SIZE: 4\n')
    tiny = tmp_path / "tiny_R_18.yaml"
    tiny.write_text(TINY.format(base=os.path.join(demo, "trees_R_26_slim_FPN.yaml")))
    out = tmp_path / "report"
    docs = _snapshot(os.path.join(REPO, "docs"))
    rc = gpu_check.main(["--device", "cpu", "--stages", "configs", "--configs", str(bad), str(tiny),
                         "--size", "64", "--batch", "1", "--iters", "2", "--out", str(out),
                         "--work-dir", str(tmp_path / "work")])
    assert rc == 1  # the report says failed (the bad config) ...
    stage = json.loads((out / "stage_configs.json").read_text())
    assert stage["status"] == "failed" and stage["iters"] == 2 and stage["device"] == stage["env"]["device"] == "cpu"
    assert stage["commit"] == gpu_check.checkout_commit()["commit"] and stage["dirty"] in (True, False)
    assert [(r["config"], r["precision"], r["status"]) for r in stage["results"]] == [
        ("bad", "fp32", "failed"), ("bad", "bf16", "failed"), ("tiny_R_18", "fp32", "ok"), ("tiny_R_18", "bf16", "ok")]
    assert all("MODEL.SASA.KERNEL_SIZE" in r["error"] for r in stage["results"][:2])
    for r in stage["results"][2:]:  # ... and the config after it was still trained
        assert len(r["losses"]) == 2, r
        assert all(0.1 < loss < 10 for loss in r["losses"])  # focal + box loss of an untrained RetinaNet
        assert r["params_without_grad"] == [] and r["params"] > 1_000_000 and r["peak_mib"] > 0
    # fp32 and bf16 start from the same weights and batch: the first losses agree to bf16 precision
    fp32, bf16 = stage["results"][2:]
    assert fp32["first_loss"] != bf16["first_loss"]
    assert abs(fp32["first_loss"] - bf16["first_loss"]) < 0.05 * fp32["first_loss"]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and report["stages"]["tests"] == {"status": "not run"}
    md = (out / "report.md").read_text()
    assert "| `tiny_R_18` | bf16 | ok |" in md and "| `bad` | fp32 | failed |" in md
    assert "configs: failed" in md and "ran on cpu, not CUDA" in md
    # merged again, the dry run still fails the check; neither touched docs/
    assert gpu_check.main(["--report-only", "--stages", "configs", "--out", str(out)]) == 1
    assert _snapshot(os.path.join(REPO, "docs")) == docs


@pytest.mark.parametrize("epochs", [2, 3, 30, 100])
def test_demo_schedule_is_a_valid_config_for_every_demo_config(gpu_check, epochs):
    from aadet.engine import apply_epoch_schedule, load_config

    for config in gpu_check.DEMO_CONFIGS:
        cfg = load_config(os.path.join(REPO, config), gpu_check.demo_schedule(epochs), freeze=False)
        assert cfg.SOLVER.EPOCHS == epochs and max(cfg.SOLVER.STEPS_EPOCHS) < epochs
        apply_epoch_schedule(cfg, num_images=62)  # the demo's 62 training tiles
        # fvcore's MultiStepParamScheduler refuses a step at (or past) the last iteration
        assert 0 < cfg.SOLVER.STEPS[0] < cfg.SOLVER.STEPS[1] < cfg.SOLVER.MAX_ITER, cfg.SOLVER
    assert gpu_check.demo_schedule(100)[:4] == ["SOLVER.EPOCHS", "100", "SOLVER.STEPS_EPOCHS", "(75, 90)"]


def test_without_cuda_the_tool_says_so(gpu_check, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit, match="needs a CUDA machine.*--device cpu --stages configs"):
        gpu_check.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"stages \['tests'\] need CUDA"):
        gpu_check.main(["--device", "cpu", "--stages", "tests", "configs", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--demo-epochs must be >= 2"):
        gpu_check.main(["--device", "cpu", "--stages", "configs", "--demo-epochs", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="STAGE=SECONDS"):
        gpu_check.main(["--device", "cpu", "--stages", "configs", "--budget", "lint=3", "--out", str(tmp_path)])


def test_report_only_merges_stage_files_of_separate_runs(gpu_check, tmp_path):
    env = dict(ENV, triton="3.6.0")
    head = gpu_check.checkout_commit()["commit"]
    (tmp_path / "stage_tests.json").write_text(json.dumps(
        {"status": "ok", "junit": gr.parse_junit(JUNIT.replace('errors="1"', 'errors="0"')), "env": env,
         "commit": head, "dirty": False}))
    bench = gr.benchmarks_cuda([config_report()], amp_dtype="bfloat16")
    (tmp_path / "stage_benchmarks.json").write_text(json.dumps(
        {"status": "ok", "benchmarks": bench, "env": env, "commit": head, "dirty": True}))
    assert gpu_check.main(["--report-only", "--out", str(tmp_path)]) == 1  # not a pass: ...
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "failed"  # ... configs and demo not run, no device recorded, a dirty tree
    assert report["stages"]["benchmarks"]["benchmarks"]["device_name"] == ENV["device_name"]
    md = (tmp_path / "report.md").read_text()
    assert "## benchmarks: ok" in md and "## configs: not run" in md and "AA-R50 RetinaNet train time" in md
    assert f"Commit {head[:12]}, uncommitted changes." in md and report["stale_stages"] == []


def test_report_only_refuses_stage_files_of_another_commit(gpu_check, tmp_path, capsys):
    head = gpu_check.checkout_commit()["commit"]
    old = "0123456789ab" + "0" * 28
    (tmp_path / "stage_tests.json").write_text(json.dumps({"status": "ok", "commit": head, "dirty": False}))
    (tmp_path / "stage_demo.json").write_text(json.dumps({"status": "ok", "commit": old, "dirty": False}))
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--report-only", "--out", str(tmp_path)])
    msg = str(e.value)
    assert f"{tmp_path / 'stage_demo.json'}: ran at commit 0123456789ab, HEAD is {head[:12]}" in msg
    assert "stage_tests.json" not in msg and not (tmp_path / "report.json").exists()
    assert gpu_check.main(["--report-only", "--allow-stale", "--out", str(tmp_path)]) == 1  # merged, not counted
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["stale_stages"] == ["demo"] and report["stages"]["demo"]["stale"]["head"] == head
    assert "stale stages from another commit: demo" in (tmp_path / "report.md").read_text()
    assert "stale stages from another commit: demo" in capsys.readouterr().out


def test_tests_stage_of_the_tool_fails_on_a_skipped_cuda_test(gpu_check, tmp_path, monkeypatch):
    # pytest itself is replaced by a fake that writes the junit XML a GPU machine without Triton would
    ran = []

    def fake_run(cmd, timeout, log_path=None, env=None):
        ran.append(cmd)
        junit = next(a.split("=", 1)[1] for a in cmd if a.startswith("--junitxml="))
        with open(junit, "w") as f:
            f.write(junit_xml(("test_cuda::test_a", "passed"),
                              ("test_aa_kernels::test_triton_cuda", "skipped:triton is not installed")))
        return 0, "1 passed, 1 skipped"

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    args = gpu_check.build_parser().parse_args(["--work-dir", str(tmp_path)])
    args.work_dir = str(tmp_path)
    out = gpu_check.stage_tests(args, gpu_check.Budget(60))
    assert ran[0][1:5] == ["-m", "pytest", "-m", "cuda"]
    assert out["status"] == "failed" and out["exit"] == 0
    assert out["error"] == "1 CUDA-marked test(s) skipped: triton is not installed (1)"
    assert out["junit"]["skipped_tests"] == [{"test": "tests.test_cuda::test_aa_kernels::test_triton_cuda",
                                              "reason": "triton is not installed"}]


DEMO_SETS = ("trees_val", "trees_test")


def _write_metrics(folder, rows):
    (folder / "metrics.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_demo_metrics_of_both_test_datasets_are_read_and_an_untrained_model_fails(gpu_check, tmp_path):
    # Detectron2 names each dataset's metrics when a run evaluates several (DATASETS.TEST of the demo)
    evals = {"trees_val/bbox/AP": 3.5, "trees_val/bbox/AP50": 12.0, "trees_val/bbox/AP75": 1.0,
             "trees_test/bbox/AP": 2.0, "trees_test/bbox/AP50": 8.0, "trees_test/bbox/AP75": 0.5}
    rows = [{"iteration": 19, "total_loss": 2.5}, {"iteration": 39, "total_loss": 1.25}, dict(iteration=39, **evals)]
    _write_metrics(tmp_path, rows)
    m = gpu_check._read_metrics(str(tmp_path), DEMO_SETS)
    assert m == {"metrics": {"trees_val": {"AP": 3.5, "AP50": 12.0, "AP75": 1.0},
                             "trees_test": {"AP": 2.0, "AP50": 8.0, "AP75": 0.5}},
                 "iters": 40, "first_loss": 2.5, "last_loss": 1.25}
    stage = {"status": "ok", "results": [dict(m, config="trees_R_26_slim_FPN", status="ok", elapsed_s=60)]}
    md = gr.render_report_markdown(gr.merge_stage_results({"demo": stage}))
    assert "| Config | Status | Iters | trees_val AP | trees_val AP50 | trees_test AP | trees_test AP50 |" in md
    assert "| `trees_R_26_slim_FPN` | ok | 40 | 3.50 | 12.00 | 2.00 | 8.00 | 2.500 | 1.250 | 60 |" in md
    # a run that evaluated one dataset writes plain bbox/ keys
    _write_metrics(tmp_path, rows[:2] + [{"iteration": 39, "bbox/AP": 3.5, "bbox/AP50": 12.0, "bbox/AP75": 1.0}])
    assert gpu_check._read_metrics(str(tmp_path), ("trees_val",))["metrics"] == {
        "trees_val": {"AP": 3.5, "AP50": 12.0, "AP75": 1.0}}
    _write_metrics(tmp_path, rows[:2] + [dict(rows[2], **{"trees_test/bbox/AP": float("nan")})])  # no detections
    with pytest.raises(RuntimeError, match="trees_test: AP is not a number.*no detections"):
        gpu_check._read_metrics(str(tmp_path), DEMO_SETS)
    _write_metrics(tmp_path, rows[:2] + [{k: v for k, v in rows[2].items() if not k.startswith("trees_test")}])
    with pytest.raises(RuntimeError, match="trees_test: .*no bbox/AP50 row"):
        gpu_check._read_metrics(str(tmp_path), DEMO_SETS)
    _write_metrics(tmp_path, rows[:1])
    with pytest.raises(RuntimeError, match="trees_val: .*not evaluated"):
        gpu_check._read_metrics(str(tmp_path), DEMO_SETS)


def test_demo_configs_evaluate_val_and_test(gpu_check):
    for config in gpu_check.DEMO_CONFIGS:
        assert gpu_check.demo_test_datasets(config) == DEMO_SETS, config


# ----------------------------------------------------------------------------- the cuda marker
PROBE = """
import json, os

import torch

# Decided before any test module is imported: skipif conditions are evaluated at import.
_CUDA = os.environ["AADET_PROBE_CUDA"] == "1"
torch.cuda.is_available = lambda: _CUDA
torch.cuda.device_count = lambda: int(_CUDA)

import pytest
from _pytest.skipping import evaluate_skip_marks


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    out = {}
    for item in items:
        skip = evaluate_skip_marks(item)
        out[item.nodeid] = {"skip": None if skip is None else skip.reason,
                            "cuda": item.get_closest_marker("cuda") is not None}
    with open(os.environ["AADET_PROBE_OUT"], "w") as f:
        json.dump(out, f)
"""


def _collect(tmp_path, cuda: bool) -> dict:
    """Every test of the suite: ``{nodeid: {"skip": reason or None, "cuda": marked}}`` with
    ``torch.cuda.is_available()`` answering ``cuda`` in the collecting process."""
    out = tmp_path / f"collected_{int(cuda)}.json"
    env = dict(os.environ, AADET_PROBE_CUDA=str(int(cuda)), AADET_PROBE_OUT=str(out),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "-p", "cuda_probe", "tests"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and out.exists(), (
        f"collecting the suite ({'with' if cuda else 'without'} CUDA) failed; its tests are unchecked:\n"
        + run.stdout[-3000:] + run.stderr[-2000:])
    return json.loads(out.read_text())


def test_every_test_that_skips_without_cuda_is_marked_cuda(tmp_path):
    # `make gpu-check` runs `pytest -m cuda`: a CUDA-only test without the marker would never run
    # there, and the report would not know. Collect the whole suite twice, with torch saying there
    # is no GPU and that there is one: whatever is skipped only in the first must be marked.
    (tmp_path / "cuda_probe.py").write_text(textwrap.dedent(PROBE))
    without, with_cuda = _collect(tmp_path, False), _collect(tmp_path, True)
    needs_cuda = {t for t, v in without.items() if v["skip"] and not with_cuda.get(t, {"skip": "absent"})["skip"]}
    needs_cuda |= set(with_cuda) - set(without)  # collected only where CUDA is
    unmarked = sorted(t for t in needs_cuda if not with_cuda[t]["cuda"])
    assert not unmarked, f"tests that need CUDA without @pytest.mark.cuda (hidden from pytest -m cuda): {unmarked}"
    # the check sees the CUDA tests: the whole of test_cuda.py and the kernels' GPU cases
    assert any(t.startswith("tests/layers/test_cuda.py::") for t in needs_cuda)
    assert "tests/layers/test_local_attention.py::test_cuda_half_autocast[dtype0]" in needs_cuda
    assert any(t.startswith("tests/layers/test_aa_kernels.py::test_triton_cuda") for t in needs_cuda)



# ----------------------------------------------------------------------------- what may pass
# Each test below closes a way the check could report a pass it did not earn.
HEAD = "c" * 40


def _snapshot(folder):
    """``{path: (size, mtime_ns)}`` of every file under ``folder``: what "touched nothing" compares."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out[os.path.join(dirpath, f)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def fake_cuda(gpu_check, monkeypatch):
    """``gpu_check.main`` on a pretend CUDA machine at a clean checkout of :data:`HEAD`, every stage
    replaced by a stub that returns ``outcome[stage]`` (default ``{"status": "ok"}``)."""
    outcome = {}
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "gpu_environment", lambda device: dict(ENV, device=device, triton="3.6.0"))
    state = {"commit": HEAD, "dirty": False}
    monkeypatch.setattr(gpu_check, "checkout_commit", lambda: dict(state))
    for name in gr.STAGES:
        monkeypatch.setitem(gpu_check.STAGE_FUNCTIONS, name,
                            lambda args, budget, name=name: dict(outcome.get(name, {"status": "ok"})))
    return outcome, state


def _stage_file(folder, name, **fields):
    stage = dict({"status": "ok", "commit": HEAD, "dirty": False, "device": "cuda", "quick": False,
                  "env": dict(ENV, device="cuda")}, **fields)
    (folder / f"stage_{name}.json").write_text(json.dumps(stage))


def test_exit_status_is_zero_only_when_every_requested_stage_ran_on_cuda_and_passed(gpu_check, fake_cuda,
                                                                                     tmp_path):
    outcome, state = fake_cuda
    run = ["--work-dir", str(tmp_path / "work")]
    assert gpu_check.main(["--stages", "tests", "benchmarks", "--out", str(tmp_path / "a"), *run]) == 0
    outcome["benchmarks"] = {"status": "failed", "error": "tools/benchmark.py exit 1"}
    assert gpu_check.main(["--stages", "tests", "benchmarks", "--out", str(tmp_path / "b"), *run]) == 1
    state["dirty"] = True  # the tree had uncommitted changes: not the commit the report names
    assert gpu_check.main(["--stages", "tests", "--out", str(tmp_path / "c"), *run]) == 1
    assert "uncommitted changes" in (tmp_path / "c" / "report.md").read_text()
    state.update(dirty=None)  # a copied tree whose state nobody checked
    assert gpu_check.main(["--stages", "tests", "--out", str(tmp_path / "d"), *run]) == 1
    state.update(dirty=False)
    assert gpu_check.main(["--stages", "tests", "--quick", "--out", str(tmp_path / "e"), *run]) == 1


def test_every_stage_records_its_device_and_the_merge_refuses_cpu_stages(gpu_check, fake_cuda, tmp_path):
    out = tmp_path / "cpu"
    # a CPU dry run of the configs stage that passes still fails the check ...
    rc = gpu_check.main(["--device", "cpu", "--stages", "configs", "--out", str(out),
                         "--work-dir", str(tmp_path / "work")])
    assert rc == 1
    stage = json.loads((out / "stage_configs.json").read_text())
    assert stage["status"] == "ok" and stage["device"] == "cpu"
    report = json.loads((out / "report.json").read_text())
    assert report["status"] != "ok" and "CUDA" in (out / "report.md").read_text()
    # ... and merged next to CUDA stages it is refused: the check does not pass
    folder = tmp_path / "merged"
    folder.mkdir()
    for name in gr.STAGES:
        _stage_file(folder, name)
    assert gpu_check.main(["--report-only", "--out", str(folder)]) == 0
    _stage_file(folder, "configs", device="cpu", env=dict(ENV, device="cpu"))
    assert gpu_check.main(["--report-only", "--out", str(folder)]) == 1
    assert "configs: ran on cpu, not CUDA" in (folder / "report.md").read_text()


def test_report_only_exits_with_the_merged_status(gpu_check, fake_cuda, tmp_path):
    _stage_file(tmp_path, "tests")
    # one stage of four: the check is incomplete, which is not a pass
    assert gpu_check.main(["--report-only", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "report.json").read_text())["status"] == "incomplete"
    # the stages a call asks for: just the tests, which passed
    assert gpu_check.main(["--report-only", "--stages", "tests", "--out", str(tmp_path)]) == 0
    _stage_file(tmp_path, "tests", status="failed", error="1 failed, 0 errors")
    assert gpu_check.main(["--report-only", "--stages", "tests", "--out", str(tmp_path)]) == 1
    # a stage of a dirty tree is not fresh, even at the same commit
    _stage_file(tmp_path, "tests", dirty=True)
    assert gpu_check.main(["--report-only", "--stages", "tests", "--out", str(tmp_path)]) == 1
    # merged anyway with --allow-stale, an old stage never makes the check pass
    _stage_file(tmp_path, "tests", commit="d" * 40)
    assert gpu_check.main(["--report-only", "--allow-stale", "--stages", "tests", "--out", str(tmp_path)]) == 1


def test_without_cuda_neither_the_check_nor_a_merged_cpu_dry_run_passes_or_touches_docs(gpu_check, tmp_path,
                                                                                        monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    docs = os.path.join(REPO, "docs")
    before = _snapshot(docs)
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path / "full"), "--work-dir", str(tmp_path / "work")])
    assert e.value.code not in (0, None)
    # a configs dry run whose stage passed (a stub: the real one is the test above), then merged
    monkeypatch.setitem(gpu_check.STAGE_FUNCTIONS, "configs", lambda args, budget: {"status": "ok"})
    out = tmp_path / "dry"
    assert gpu_check.main(["--device", "cpu", "--stages", "configs", "--out", str(out),
                           "--work-dir", str(tmp_path / "work")]) != 0
    assert gpu_check.main(["--report-only", "--stages", "configs", "--out", str(out)]) != 0
    assert _snapshot(docs) == before


def test_report_shows_every_stage_environment_and_ran_apart_from_targets_met(gpu_check, fake_cuda, tmp_path):
    bench = gr.benchmarks_cuda([config_report()], [layer_report(False, 0.002, 0.005, 100 * MIB, 150 * MIB),
                                                   layer_report(True, 0.001, 0.0015, 50, 60)], amp_dtype="bfloat16")
    for name in gr.STAGES:
        _stage_file(tmp_path, name, env=dict(ENV, device="cuda", triton="3.6.0", driver=f"driver-of-{name}"))
    _stage_file(tmp_path, "benchmarks", benchmarks=bench,
                env=dict(ENV, device="cuda", triton="3.6.0", driver="driver-of-benchmarks"))
    assert gpu_check.main(["--report-only", "--out", str(tmp_path)]) == 0  # every stage ran and passed ...
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["status"] == "ok" and report["targets"]["status"] == "missed"  # ... targets missed
    assert report["targets"]["missed"] >= 1 and report["targets"]["missing"] >= 1  # the bf16 OOM row
    md = (tmp_path / "report.md").read_text()
    assert all(f"driver-of-{name}" in md for name in gr.STAGES)
    title = md.splitlines()[0]
    assert title.startswith("# aadet GPU check: ok") and "targets" in title and "missed" in title


# ----------------------------------------------------------------------------- the benchmark record
def _fake_benchmark_tools(calls, fail=(), precisions=("fp32", "bf16")):
    """A ``gpu_check._run`` that writes what ``tools/benchmark*.py`` would for the command it is
    given (sizes, batch, iterations from the command; the numbers of :func:`config_report`), with
    ``fail``: ``(config, amp)`` cases that error and layer suites whose runs fail, ``precisions``: the
    ones the device can run."""
    def value(cmd, flag, default=None):
        return type(default)(cmd[cmd.index(flag) + 1]) if flag in cmd else default

    def run(cmd, timeout, log_path=None, env=None):
        calls.append(cmd)
        if "--help" in cmd:
            return 0, "--amp-dtype"
        out = cmd[cmd.index("--output-json") + 1]
        if cmd[1].endswith("benchmark.py"):
            rep = config_report(size=[value(cmd, "--size", 0)] * 2, batch=value(cmd, "--batch", 0),
                                iters=value(cmd, "--iters", 0), warmup=value(cmd, "--warmup", 0))
            rep["results"][-1] = _case(FULL, True, 0.200, 0.100, 1200)  # every case measured
            amps = {"both": [False, True], "on": [True], "off": [False]}[value(cmd, "--amp", "off")]
            configs = cmd[cmd.index("--configs") + 1:]
            configs = configs[:next(i for i, c in enumerate(configs) if c.startswith("--"))]
            rep["results"] = [r for r in rep["results"] if r["amp"] in amps and r["config"] in configs]
            if "--compile" in cmd:  # compiled: every step 20% shorter
                rep["results"] = [dict(r, train=dict(r["train"], median_s=0.8 * r["train"]["median_s"]))
                                  for r in rep["results"]]
            if "bf16" not in precisions:
                rep["results"] = [dict(r, error="bfloat16 is not supported on this device") if r["amp"] else r
                                  for r in rep["results"]]
            rep["results"] = [dict(r, error="CUDA error: an illegal memory access")
                              if (r["config"], r["amp"]) in fail else r for r in rep["results"]]
            # as benchmark.py writes a failed case: the error, no numbers
            rep["results"] = [{k: v for k, v in r.items() if "error" not in r or k not in ("train", "inference")}
                              for r in rep["results"]]
        else:
            amp, suite = "--amp" in cmd, value(cmd, "--suite", "")
            rep = layer_report(amp, 0.002, 0.005, 100 * MIB, 150 * MIB, suite=suite)
            rep.update(batch=value(cmd, "--batch", 0), iters=value(cmd, "--iters", 0),
                       warmup=value(cmd, "--warmup", 0))
            if amp and "bf16" not in precisions:
                return 1, "RuntimeError: bfloat16 is not supported on this device"
            if suite in fail:
                return 1, f"RuntimeError: the {suite} suite crashed"
        with open(out, "w") as f:
            json.dump(rep, f)
        return 0, ""
    return run


def _bench_args(gpu_check, tmp_path, *extra):
    record = tmp_path / "docs" / "benchmarks_cuda.json"
    record.parent.mkdir(exist_ok=True)
    args = gpu_check.build_parser().parse_args(
        ["--bench-json", str(record), "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
         *extra])
    for d in (args.out, args.work_dir):
        os.makedirs(d, exist_ok=True)
    return args, record


def _scratch(tmp_path):
    found = [p for p in (tmp_path / "work").rglob("*.json") if "scratch" in p.name]
    assert len(found) == 1 and "docs" not in found[0].parts, found
    return json.loads(found[0].read_text())


@pytest.mark.parametrize("case", ["complete", "few_iterations", "a_case_failed", "no_bf16"])
def test_the_benchmark_record_comes_only_from_a_complete_run_at_the_targets_protocol(gpu_check, tmp_path,
                                                                                     monkeypatch, case):
    calls = []
    fail = {(AA, True)} if case == "a_case_failed" else set()
    precisions = ("fp32",) if case == "no_bf16" else ("fp32", "bf16")
    monkeypatch.setattr(gpu_check, "_run", _fake_benchmark_tools(calls, fail, precisions))
    extra = ["--bench-iters", "1", "--bench-warmup", "0"] if case == "few_iterations" else []
    args, record = _bench_args(gpu_check, tmp_path, *extra)
    result = gpu_check.stage_benchmarks(args, gpu_check.Budget(600))
    bench_cmd = next(c for c in calls if c[1].endswith("benchmark.py") and "--help" not in c)
    assert bench_cmd[bench_cmd.index("--size") + 1] == "640" and bench_cmd[bench_cmd.index("--batch") + 1] == "8"
    assert "--in-process" in bench_cmd  # no process a case (20-35 s each at 3a55981, all timed out)
    # every case profiled once more, so that each time target says what bounds it
    assert all("--profile" in c for c in calls if "--help" not in c and "--output-json" in c)
    if case == "complete":
        assert result["status"] == "ok"
        written = json.loads(record.read_text())
        assert written["comparable"] is True and {t["status"] for t in written["targets"]} <= {"pass", "miss"} | {
            "missing"}
        return
    assert result["status"] != "ok" and not record.exists()  # nothing goes to docs/
    scratch = _scratch(tmp_path)
    assert scratch["scratch"].startswith("not the record")
    if case == "few_iterations":
        assert "iterations" in scratch["scratch"] and scratch["comparable"] is False
    if case == "no_bf16":  # the bf16 targets are missing, not gone
        bf16 = [t for t in scratch["targets"] if t["precision"] == "bf16"]
        assert bf16 and all(t["status"] == "missing" for t in bf16)


def test_a_missing_precision_or_row_is_missing_not_absent():
    fp32_only = dict(config_report(), results=[r for r in config_report()["results"] if not r["amp"]])
    bench = gr.benchmarks_cuda([fp32_only], [layer_report(False, 0.002, 0.005, 100 * MIB, 150 * MIB)])
    bf16 = [t for t in bench["targets"] if t["precision"] == "bf16"]
    assert len(bf16) == len(gr.TARGETS) and all(t["status"] == "missing" for t in bf16)
    assert bench["comparable"] is False and "bf16" in bench["not_comparable_why"]
    no_sasa = dict(config_report(), results=[r for r in config_report()["results"] if r["config"] != SASA])
    bench = gr.benchmarks_cuda([no_sasa], amp_dtype="bfloat16")
    assert {f"{gr.config_name(SASA)} fp32", f"{gr.config_name(SASA)} bf16"} <= set(bench["missing"])
    md = gr.render_benchmarks_markdown(bench)
    assert f"`{gr.config_name(SASA)}` | fp32 | missing" in md


# ----------------------------------------------------------------------------- MODEL.COMPILE, no target
def test_the_benchmarks_stage_measures_the_compiled_models_last_without_a_target(gpu_check, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_check, "_run", _fake_benchmark_tools(calls))
    args, record = _bench_args(gpu_check, tmp_path)
    result = gpu_check.stage_benchmarks(args, gpu_check.Budget(600))
    runs = [c for c in calls if "--output-json" in c]
    last = runs[-1]
    assert last[1].endswith("tools/benchmark.py") and "--compile" in last and "--profile" in last
    assert last[last.index("--amp") + 1] == "on" and last[last.index("--amp-dtype") + 1] == "bfloat16"
    assert last[last.index("--configs") + 1:last.index("--device")] == list(gr.COMPILED_CONFIGS)
    assert sum("--compile" in c for c in runs) == 1  # the eager cases and the layers before it
    assert result["status"] == "ok" and record.exists()
    bench = json.loads(record.read_text())
    assert "compiled bf16" not in bench["informational_missing"]
    aa = _one(bench["compiled"], config=gr.config_name(AA), precision="bf16")
    assert aa["compiled"] is True and aa["eager_train_ms_ratio"] == pytest.approx(0.8)
    assert aa["train_ms_ratio"] == pytest.approx(1.2)  # to the compiled baseline
    assert not [t for t in bench["targets"] if t.get("compiled")]
    md = gr.render_benchmarks_markdown(bench)
    assert "| `aa_retinanet_R_50_FPN_scratch_150ep` | bf16 | 96.0 | 1.20 | 0.80 |" in md


def test_compiled_models_without_time_left_are_not_measured_and_do_not_fail_the_stage(gpu_check, tmp_path,
                                                                                     monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_check, "_run", _fake_benchmark_tools(calls))
    monkeypatch.setattr(gpu_check, "COMPILED_MIN_S", 10**6)
    args, record = _bench_args(gpu_check, tmp_path)
    result = gpu_check.stage_benchmarks(args, gpu_check.Budget(600))
    assert not [c for c in calls if "--compile" in c]
    assert result["status"] == "ok" and record.exists()
    assert any("--compile (bf16) not run" in n for n in result["notes"])
    bench = json.loads(record.read_text())
    assert bench["complete"] and bench["compiled"] == [] and "compiled bf16" in bench["informational_missing"]
    assert "Compiled models (MODEL.COMPILE, no target) not measured in bf16." in gr.render_benchmarks_markdown(bench)


# ----------------------------------------------------------------------------- what bounds a target
def _profile(device_ms, host_ops=None, **categories):
    """A phase's profile as ``aadet.benchmark.step_profile.profile_call`` writes it (its largest
    operator of each kind named ``op_<kind>``)."""
    cats = dict({c: 0.0 for c in ("attention", "conv", "matmul", "norm", "copy", "other")}, **categories)
    assert sum(cats.values()) == pytest.approx(device_ms)
    top = sorted(({"op": f"op_{c}", "ms": v, "calls": 3, "category": c} for c, v in cats.items() if v),
                 key=lambda r: -r["ms"])
    return {"device": "cuda", "profiled_ms": 1.3 * device_ms, "device_ms": device_ms, "device_events": 1500,
            "categories": cats, "top": top, "host_syncs": {"aten::_local_scalar_dense": 4, "aten::nonzero": 2},
            "host_ops": host_ops}


def test_each_time_target_says_what_bounds_it_from_the_profiles():
    rep = config_report()
    profiles = {  # bf16 training: the conv 100 ms, AA 120 ms, SASA 150 ms (config_report's medians)
        BASE: _profile(90.0, 3200, conv=70.0, other=20.0),
        AA: _profile(72.0, 4900, conv=40.0, attention=20.0, other=12.0),  # the GPU idle 40% of the step
        SASA: _profile(140.0, conv=40.0, attention=80.0, copy=20.0),
    }
    for r in rep["results"]:
        if r["amp"] and r["config"] in profiles:
            r["train"]["profile"] = profiles[r["config"]]
    layers = layer_report(True, 0.001, 0.0015, 50, 60)
    for r in layers["results"]:
        r["profile"] = _profile(1.4, attention=1.0, copy=0.4) if r["impl"] == "fused" else _profile(0.9, conv=0.9)
    bench = gr.benchmarks_cuda([rep], [layers], amp_dtype="bfloat16")
    t = {(v["target"], v["precision"], v["subject"]): v for v in bench["targets"]}
    aa = t[("AA-R50 RetinaNet train time", "bf16", gr.config_name(AA))]
    assert aa["bound"] == ("host-bound: device busy 60% of 120.0 ms, 1500 kernels, 4900 operators (1.53x the "
                           "baseline's), 6 host syncs (baseline 6); "
                           "beyond the baseline's device time: attention +20.0 ms (op_attention 20.0 ms)")
    sasa = t[("SASA attention-backbone RetinaNet train time", "bf16", gr.config_name(SASA))]
    assert sasa["bound"] == ("device-bound: device busy 93% of 150.0 ms, 1500 kernels; beyond the baseline's "
                             "device time: attention +80.0 ms (op_attention 80.0 ms), "
                             "copy +20.0 ms (op_copy 20.0 ms)")
    layer = t[("LocalSelfAttention2d 256 ch k 7 80x80 fwd+bwd time vs 3x3 conv", "bf16", "sasa_fused_80")]
    assert layer["bound"].startswith("device-bound: device busy 93% of 1.5 ms")
    assert "attention +1.0 ms" in layer["bound"]
    # no profile (fp32 here), a memory target, an inference target without an inference profile: no bound
    assert "bound" not in t[("AA-R50 RetinaNet train time", "fp32", gr.config_name(AA))]
    assert "bound" not in t[("AA-R50 RetinaNet train memory", "bf16", gr.config_name(AA))]
    assert "bound" not in t[("AA-R50 RetinaNet inference time", "bf16", gr.config_name(AA))]
    assert _one(bench["configs"], config=gr.config_name(AA), precision="bf16")["train_profile"]["device_ms"] == 72.0
    md = gr.render_benchmarks_markdown(bench)
    assert "What bounds it (one profiled step)" in md and f"| {aa['bound']} |" in md
    # without the baseline's profile the bound names the row's own largest kinds of work
    alone = gr.describe_bound({"train_ms": 120.0, "train_profile": gr.profile_summary(profiles[AA])}, None)
    assert "4900 operators, 6 host syncs;" in alone
    assert alone.endswith("device time: conv 40.0 ms (op_conv 40.0 ms), attention 20.0 ms (op_attention 20.0 ms)")


# ----------------------------------------------------------------------------- the HaloNet layer, no target
def _layer_cmds(calls):
    return [(c[c.index("--suite") + 1], "--amp" in c) for c in calls if c[1].endswith("benchmark_layers.py")]


def test_the_benchmarks_stage_times_the_halo_layer_after_the_sasa_layer_without_a_target(gpu_check, tmp_path,
                                                                                         monkeypatch):
    calls = []
    monkeypatch.setattr(gpu_check, "_run", _fake_benchmark_tools(calls))
    args, record = _bench_args(gpu_check, tmp_path)
    result = gpu_check.stage_benchmarks(args, gpu_check.Budget(600))
    # the SASA layer (the targets) first, then the HaloNet layer, each in fp32 and bf16
    assert _layer_cmds(calls) == [("sasa", False), ("sasa", True), ("halo", False), ("halo", True)]
    assert result["status"] == "ok" and record.exists()
    bench = json.loads(record.read_text())
    assert bench["complete"] and bench["informational_missing"] == []
    halo = [r for r in bench["layers"] if r["suite"] == "halo"]
    assert {(r["impl"], r["precision"]) for r in halo} == {
        (i, p) for i in ("fused", "materialized", "sasa", "conv3x3") for p in ("fp32", "bf16")}
    fused = _one(halo, impl="fused", precision="fp32")  # against the halo suite's own 3x3 conv
    assert fused["layer"] == "halo_fused_80" and fused["train_ms_ratio"] == pytest.approx(2.5)
    assert fused["train_peak_mib_ratio"] == pytest.approx(1.5)
    assert not [t for t in bench["targets"] if t["subject"].startswith("halo_fused")]  # the layer: reported, not judged
    md = gr.render_benchmarks_markdown(bench)
    assert "| `halo_fused_80` | fp32 | 80x80 | 256 | 5.00 | 2.50 | 150 | 1.50 | no target: as measured |" in md
    assert "| `sasa_fused_80` | fp32 | 80x80 | 256 | 5.00 | 2.50 | 150 | 1.50 |  |" in md


@pytest.mark.parametrize("case", ["halo_fails", "budget_spent"])
def test_a_halo_layer_not_measured_is_reported_and_neither_fails_the_stage_nor_the_record(gpu_check, tmp_path,
                                                                                         monkeypatch, case):
    calls = []
    monkeypatch.setattr(gpu_check, "_run", _fake_benchmark_tools(calls, fail={"halo"} if case == "halo_fails" else ()))
    budget = gpu_check.Budget(600)
    if case == "budget_spent":  # spent by benchmark.py and the two SASA runs
        monkeypatch.setattr(budget, "left", lambda: 600.0 if len(calls) < 3 else 0.0)
    args, record = _bench_args(gpu_check, tmp_path)
    result = gpu_check.stage_benchmarks(args, budget)
    halo_runs = [c for c in _layer_cmds(calls) if c[0] == "halo"]
    assert len(halo_runs) == (2 if case == "halo_fails" else 0)
    assert result["status"] == "ok" and "error" not in result and record.exists()
    bench = json.loads(record.read_text())
    assert bench["complete"] and bench["missing"] == []
    # the compiled models after the halo layer: measured where it failed, not where the budget was spent
    compiled = [] if case == "halo_fails" else ["compiled bf16"]
    assert bench["informational_missing"] == ["halo fp32", "halo bf16"] + compiled
    why = "the halo suite crashed" if case == "halo_fails" else "stage budget spent"
    assert sum("--suite halo" in n and why in n for n in result["notes"]) == 2, result["notes"]
    md = gr.render_benchmarks_markdown(bench)
    assert "`halo` layer (no target) not measured in fp32." in md and "`halo_fused_80`" not in md


def test_halo_rows_do_not_stand_in_for_a_missing_sasa_layer():
    fp32 = layer_report(False, 0.002, 0.005, 100 * MIB, 150 * MIB)
    halo = [layer_report(amp, 0.002, 0.005, 100 * MIB, 150 * MIB, suite="halo") for amp in (False, True)]
    bench = gr.benchmarks_cuda([config_report()], [fp32, *halo], amp_dtype="bfloat16")
    assert [m for m in bench["missing"] if m.startswith("layers")] == ["layers bf16"] and not bench["complete"]
    assert bench["informational_missing"] == ["compiled bf16"]  # the halo layer measured; no compiled run given
    bf16_layer_targets = [t for t in bench["targets"] if t["precision"] == "bf16" and t["metric"].startswith("train_")
                          and "3x3 conv" in t["target"]]
    assert bf16_layer_targets and all(t["status"] == "missing" for t in bf16_layer_targets)
    # a halo layer whose routes all failed is not measured, though its 3x3 conv was
    broken = layer_report(False, 0.002, 0.005, 100 * MIB, 150 * MIB, suite="halo")
    broken["results"] = [dict(r, error="CUDA out of memory") if r["impl"] != "conv3x3" else r
                         for r in broken["results"]]
    assert gr.informational_missing(gr.layer_rows(broken)) == ["halo fp32", "halo bf16"]


# ----------------------------------------------------------------------------- a stage cut off at its budget
def test_a_command_cut_off_keeps_what_it_printed_and_leaves_no_process_behind(gpu_check, tmp_path):
    # a benchmark whose worker holds the GPU: the worker must die with it, and the progress
    # printed before the timeout (stderr and buffered stdout) must reach the log
    pid_file = tmp_path / "worker.pid"
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(worker.pid))
        print("case 1 done", file=sys.stderr)
        print("progress on stdout")
        time.sleep(60)
    """)
    log = tmp_path / "log.txt"
    rc, tail = gpu_check._run([sys.executable, "-c", script], timeout=3, log_path=str(log))
    assert rc == "timeout"
    assert "case 1 done" in tail and "progress on stdout" in tail and "timed out after 3 s" in log.read_text()
    worker = int(pid_file.read_text())
    time.sleep(0.2)
    state = open(f"/proc/{worker}/stat").read().split()[2] if os.path.exists(f"/proc/{worker}") else "gone"
    assert state in ("gone", "Z"), f"the worker {worker} outlived the timeout (state {state})"


def _progress_lines(*records):
    return "\n".join(json.dumps(r) for r in records) + "\n"


def test_test_progress_counts_what_finished_before_a_timeout():
    text = _progress_lines(
        {"collected": 5},
        {"test": "t::a", "when": "call", "outcome": "passed", "duration_s": 4.0},
        {"test": "t::b", "when": "call", "outcome": "passed", "duration_s": 1.0},
        {"test": "t::b", "when": "teardown", "outcome": "failed", "duration_s": 0.5},  # a failed teardown fails b
        {"test": "t::c", "when": "setup", "outcome": "skipped", "duration_s": 0.0},
    )
    p = gr.parse_test_progress(text)
    assert (p["collected"], p["finished"], p["passed"], p["failed"], p["skipped"]) == (5, 3, 1, 1, 1)
    assert p["failures"] == ["t::b"] and p["slowest"][:2] == [["t::a", 4.0], ["t::b", 1.5]]
    out = gr.tests_stage_result(None, "timeout", p)
    assert out["status"] == "failed"  # what finished is said, never counted as a pass
    assert out["error"].startswith("pytest wrote no junit XML (exit timeout); before it stopped: "
                                   "3 finished of 5 collected: 1 passed, 1 failed, 1 skipped")
    assert "failed: t::b" in out["error"] and "slowest: t::a 4 s" in out["error"]


def test_tests_stage_runs_pytest_in_parallel_and_reads_the_progress_of_a_run_cut_off(gpu_check, tmp_path,
                                                                                    monkeypatch):
    ran = []

    def fake_run(cmd, timeout, log_path=None, env=None):  # pytest cut off: progress, no junit XML
        ran.append(cmd)
        with open(env[gr.TEST_PROGRESS_ENV], "w") as f:
            f.write(_progress_lines({"collected": 238},
                                    {"test": "t::a", "when": "call", "outcome": "passed", "duration_s": 2.0}))
        return "timeout", "[gpu_check] timed out"

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    args = gpu_check.build_parser().parse_args(["--work-dir", str(tmp_path)])
    out = gpu_check.stage_tests(args, gpu_check.Budget(60))
    assert ran[0][ran[0].index("-n") + 1] == str(args.test_workers) == "8"
    assert out["status"] == "failed" and out["progress"]["passed"] == 1
    assert "before it stopped: 1 finished of 238 collected: 1 passed, 0 failed" in out["error"]
    args = gpu_check.build_parser().parse_args(["--work-dir", str(tmp_path), "--test-workers", "0"])
    gpu_check.stage_tests(args, gpu_check.Budget(60))
    assert "-n" not in ran[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_progress_record_has_one_line_per_test_with_or_without_xdist(tmp_path, workers):
    record = tmp_path / "progress.jsonl"
    tests = "dev/tests/test_gpu_check.py::test_test_progress_counts_what_finished_before_a_timeout"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests,
           "dev/tests/test_gpu_check.py::test_parse_junit_counts_and_messages"]
    cmd += ["-n", str(workers)] if workers else []
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, **{gr.TEST_PROGRESS_ENV: str(record)}))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    progress = gr.parse_test_progress(record.read_text())
    assert (progress["collected"], progress["finished"], progress["passed"]) == (2, 2, 2)
    assert len(record.read_text().splitlines()) == 3  # no line twice (xdist's workers do not write)


def test_a_benchmark_cut_off_reports_the_cases_it_finished_as_scratch(gpu_check, tmp_path, monkeypatch):
    calls = []
    complete = _fake_benchmark_tools(calls)

    def run(cmd, timeout, log_path=None, env=None):
        rc, out = complete(cmd, timeout, log_path, env)
        if cmd[1].endswith("benchmark.py"):  # cut off after the conv and AA fp32 cases
            path = cmd[cmd.index("--output-json") + 1]
            with open(path) as f:
                rep = json.load(f)
            with open(path, "w") as f:
                json.dump(dict(rep, results=rep["results"][:2], partial=True), f)
            return "timeout", "[benchmark] configs/COCO-Detection/sasa_convstem... amp=off ..."
        return rc, out

    monkeypatch.setattr(gpu_check, "_run", run)
    args, record = _bench_args(gpu_check, tmp_path)
    result = gpu_check.stage_benchmarks(args, gpu_check.Budget(600))
    assert result["status"] == "failed" and not record.exists()
    assert "tools/benchmark.py exit timeout after 2 finished case(s)" in result["error"]
    scratch = _scratch(tmp_path)
    aa_train = _one(scratch["targets"], target="AA-R50 RetinaNet train time", precision="fp32")
    assert aa_train["value"] == pytest.approx(1.05)  # the finished cases' numbers are kept
    sasa = [t for t in scratch["targets"] if t["subject"] == gr.config_name(SASA)]
    assert sasa and all(t["status"] == "missing" for t in sasa)


def test_the_loan_plan_fits_its_calls_and_the_session():
    """Each call's install, stage budgets and finish fit its length, which fits a command's limit;
    both calls on one machine start fit a session's device time; every stage is in a call, the
    sweep first, each call's stages in the order of STAGES."""
    plan = gr.LOAN_PLAN
    order = list(gr.STAGES)
    for call in plan.values():
        used = call["install_s"] + sum(call["stages"].values()) + call["finish_s"]
        assert used <= call["call_s"] <= gr.CALL_LIMIT_S, call
        names = list(call["stages"])
        assert names == sorted(names, key=order.index), names
    assert plan["first"]["call_s"] <= 9 * 60 and plan["second"]["call_s"] <= 4 * 60
    assert gr.MACHINE_START_S + sum(c["call_s"] for c in plan.values()) <= gr.SESSION_DEVICE_S
    in_calls = {s for c in plan.values() for s in c["stages"]}
    assert in_calls | set(gr.LOAN_LEFT_OUT) == set(order) and not in_calls & set(gr.LOAN_LEFT_OUT)
    assert list(plan["first"]["stages"])[0] == "sweep"
    lines = gr.loan_plan_lines()
    assert lines[0].startswith("first: install 25 s, sweep 170 s") and "of the session's 900 s" in lines[-1]


def test_plan_option_prints_the_budgets_the_loan_script_reads(gpu_check, capsys):
    assert gpu_check.main(["--plan", "second"]) == 0
    assert capsys.readouterr().out.split() == [f"{k}={v}" for k, v in gr.LOAN_PLAN["second"]["stages"].items()]
