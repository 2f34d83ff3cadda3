"""The COCO cost model (``dev/aadet_dev/cost.py``) and its tool (``dev/coco_cost.py``): the
schedule and the batch/LR rule agree with what training does, the estimates follow their formula,
a benchmark turns rows into measured ones, and the tool prints and writes its block (the committed
doc's block itself: dev/tests/test_generated_docs.py)."""
import json
import os

import pytest

from aadet_dev import cost

from tests.helpers import REPO, load_dev

R50 = "retinanet_R_50_FPN_scratch_150ep"


def facts(name=R50, gflops=190.3, attention_gflops=0.0, attention=None, params_m=33.85):
    return cost.ConfigFacts(name, gflops, attention_gflops, params_m, attention, 64, 150)


def test_schedule_matches_the_epoch_conversion_of_training():
    from aadet.engine import epochs_to_iters

    assert cost.schedule_iterations(150, cost.COCO_TRAIN_IMAGES, 64) == 274_843
    assert epochs_to_iters(150, cost.COCO_TRAIN_IMAGES, 64) == 274_843
    assert cost.schedule_iterations(100, 117_266, 64) == epochs_to_iters(100, 117_266, 64)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 16])
def test_auto_scale_is_detectron2s(gpus):
    from detectron2.engine import DefaultTrainer

    from aadet.engine import load_config

    cfg = load_config(os.path.join(REPO, "configs", "COCO-Detection", R50 + ".yaml"),
                      ["SOLVER.MAX_ITER", "274843", "SOLVER.STEPS", "(183229, 243694)",
                       "SOLVER.REFERENCE_WORLD_SIZE", "8"])
    s = cfg.SOLVER
    solver = {"IMS_PER_BATCH": s.IMS_PER_BATCH, "BASE_LR": s.BASE_LR, "MAX_ITER": s.MAX_ITER,
              "WARMUP_ITERS": s.WARMUP_ITERS, "STEPS": tuple(s.STEPS),
              "CHECKPOINT_PERIOD": s.CHECKPOINT_PERIOD, "REFERENCE_WORLD_SIZE": 8}
    ours = cost.auto_scale(solver, gpus)
    d2 = DefaultTrainer.auto_scale_workers(cfg, gpus).SOLVER
    assert ours == {"IMS_PER_BATCH": d2.IMS_PER_BATCH, "BASE_LR": d2.BASE_LR, "MAX_ITER": d2.MAX_ITER,
                    "WARMUP_ITERS": d2.WARMUP_ITERS, "STEPS": tuple(d2.STEPS),
                    "CHECKPOINT_PERIOD": d2.CHECKPOINT_PERIOD, "REFERENCE_WORLD_SIZE": gpus}
    assert cost.auto_scale(dict(solver, REFERENCE_WORLD_SIZE=0), gpus)["IMS_PER_BATCH"] == 64


def test_the_conv_reference_follows_the_formula():
    row = cost.estimate_row(facts(), 190.3, "V100")
    ref = cost.REFERENCES["V100"]
    expect = 8 / cost.PIXEL_RATIO.nominal * cost.RECIPE_OVERHEAD.nominal / ref.images_per_s_per_gpu.nominal
    assert row.s_per_iter.nominal == pytest.approx(expect)
    assert row.s_per_iter.low < row.s_per_iter.nominal < row.s_per_iter.high
    assert row.iterations == 274_843 and row.source == "estimated" and row.gpu == "V100"
    assert row.gpu_hours.nominal == pytest.approx(8 * row.wall_h.nominal)
    assert row.wall_h.nominal == pytest.approx(274_843 * expect / 3600)
    static = 16 * 33.85e6 / 2 ** 30
    assert row.memory_gib.low > static and row.memory_gib.high < 16


def test_attention_costs_more_than_its_flops():
    plain = cost.estimate_row(facts(gflops=180.0), 190.3)
    local = cost.estimate_row(facts(gflops=180.0, attention_gflops=5.0, attention="local"), 190.3)
    glob = cost.estimate_row(facts(gflops=180.0, attention_gflops=5.0, attention="global"), 190.3)
    k = cost.ATTENTION_COST["local"]
    assert local.s_per_iter.nominal / plain.s_per_iter.nominal == pytest.approx((175 + k.nominal * 5) / 180)
    assert plain.s_per_iter.nominal < glob.s_per_iter.nominal < local.s_per_iter.nominal
    assert local.s_per_iter.high / local.s_per_iter.low > plain.s_per_iter.high / plain.s_per_iter.low
    with pytest.raises(ValueError, match="no reference measurement for GPU 'H100'"):
        cost.estimate_row(facts(), 190.3, "H100")


def test_a_benchmark_makes_rows_measured():
    configs = [facts(), facts("aa_x", 192.0, 3.3, "global")]
    bench = {"size": [640, 640], "batch": 8, "device_name": "NVIDIA H100 80GB HBM3",
             "configs": [{"config": R50, "precision": "fp32", "train_ms": 150.0, "train_peak_mib": 9216.0},
                         {"config": R50, "precision": "bf16", "train_ms": 90.0, "train_peak_mib": 5000.0}]}
    rows = {r.name: r for r in cost.cost_rows(configs, R50, bench)}
    m = rows[R50]
    assert (m.source, m.gpu, m.memory_source) == ("measured", "NVIDIA H100 80GB HBM3", "measured")
    assert m.s_per_iter.nominal == pytest.approx(0.150 * cost.DDP_OVERHEAD.nominal)
    assert m.memory_gib.nominal == pytest.approx(9.0)
    assert rows["aa_x"].source == "estimated"  # not benchmarked
    smoke = dict(bench, size=[256, 256])
    assert "256" in cost.bench_unusable(smoke)
    assert {r.source for r in cost.cost_rows(configs, R50, smoke)} == {"estimated"}
    assert "does not exist" in cost.bench_unusable(None)
    table = cost.render_cost_table(cost.cost_rows(configs, R50, bench), configs)
    assert "| `retinanet_R_50_FPN_scratch_150ep` | measured | NVIDIA H100 80GB HBM3 |" in table


def test_read_model_table_finds_columns_by_name():
    text = ("| Config | Params (M) | Input | GFLOPs | Attention GFLOPs | New column |\n"
            "|:---|---:|---:|---:|---:|---:|\n"
            "| `COCO-Detection/aa_x` | 33.42 | 640 | 192.0 | 3.29 | 1 |\n")
    assert cost.read_model_table(text) == {
        "aa_x": {"gflops": 192.0, "attention_gflops": 3.29, "params_m": 33.42, "input": "640"}}
    with pytest.raises(ValueError, match="Attention GFLOPs"):
        cost.read_model_table("| Config | Input | Params (M) | GFLOPs |\n|---|---|---|---|\n")


def test_scaling_table_keeps_epochs_and_images_per_gpu():
    solver = {"IMS_PER_BATCH": 64, "BASE_LR": 0.04, "MAX_ITER": 274_843, "WARMUP_ITERS": 2000,
              "STEPS": (183_229, 243_694), "CHECKPOINT_PERIOD": 5000, "REFERENCE_WORLD_SIZE": 0}
    table = cost.render_scaling_table(solver, (4, 8))
    assert "| 4 | 0 | 64 | 16 | 0.04 | 274,843 |" in table  # as configured: 16 images per GPU
    assert "| 4 | 8 | 32 | 8 | 0.02 | 549,686 | 4,000 |" in table  # REFERENCE_WORLD_SIZE 8
    assert table.count("2.00x") == 2


def _model_table(tmp_path, gflops):
    """A made-up model table with every COCO config at 640 (the columns the tool reads)."""
    names = [os.path.splitext(os.path.basename(c))[0] for c in cost.coco_configs(REPO)]
    rows = [f"| `COCO-Detection/{n}` | 30.00 | 640 | {gflops:.1f} | {0.0 if n.startswith('retinanet') else 3.0} |"
            for n in names]
    path = tmp_path / "model_table.md"
    path.write_text("| Config | Params (M) | Input | GFLOPs | Attention GFLOPs |\n|:---|---:|---:|---:|---:|\n"
                    + "\n".join(rows) + "\n")
    return str(path)


def test_the_tool_prints_and_writes_its_block(tmp_path, capsys):
    """``dev/coco_cost.py`` on a made-up model table and benchmark: one row per COCO config,
    the benchmarked one measured; ``--write`` replaces the block of a document and nothing else."""
    tool = load_dev("coco_cost")
    table = _model_table(tmp_path, 190.0)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"size": [640, 640], "batch": 8, "device_name": "Some GPU", "configs": [
        {"config": R50, "precision": "fp32", "train_ms": 150.0, "train_peak_mib": 9216.0}]}))
    assert tool.main(["--model-table", table, "--bench", str(bench)]) == 0
    block = capsys.readouterr().out
    assert block.startswith(cost.BEGIN) and block.rstrip().endswith(cost.END)
    rows = [ln for ln in block.splitlines() if ln.startswith("| `")]
    assert len(rows) == len(cost.coco_configs(REPO))
    assert [r for r in rows if " measured " in r] == [r for r in rows if r.startswith(f"| `{R50}` |")]
    assert all(" estimated " in r for r in rows if not r.startswith(f"| `{R50}` |"))

    doc = tmp_path / "doc.md"
    doc.write_text(f"# Cost\n\n{cost.BEGIN}\nold\n{cost.END}\n\ntail\n")
    assert tool.main(["--model-table", table, "--bench", str(bench), "--write", str(doc)]) == 0
    assert doc.read_text() == "# Cost\n\n" + block + "\ntail\n"
    doc.write_text("# no block\n")
    assert tool.main(["--model-table", table, "--bench", str(bench), "--write", str(doc)]) == 1
    assert "coco-cost:begin" in capsys.readouterr().err and doc.read_text() == "# no block\n"


def test_the_tool_names_a_config_missing_from_the_model_table(tmp_path, capsys):
    table = tmp_path / "model_table.md"
    table.write_text("| Config | Params (M) | Input | GFLOPs | Attention GFLOPs |\n|:---|---:|---:|---:|---:|\n"
                     f"| `COCO-Detection/{R50}` | 33.85 | 640 | 190.3 | 0.00 |\n")
    assert load_dev("coco_cost").main(["--model-table", str(table), "--bench", str(tmp_path / "none")]) == 1
    assert "is not in the model table" in capsys.readouterr().err
