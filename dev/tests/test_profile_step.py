"""``dev/profile_step.py``: where one training step of a config spends its time (forward per
part, the rest of the step, the top operators), as JSON."""
import json
import os

import pytest

from tests.helpers import REPO, load_dev

AA_DEMO = os.path.join(REPO, "configs", "Demo", "trees_AA_R_26_slim_FPN.yaml")


@pytest.mark.slow
def test_profile_of_the_aa_demo(tmp_path):
    """One tiny step of the AA demo: the forward parts are the backbone's stages, FPN and head, and
    add up to the profiled step with the rest; the AA attention shows as its autograd Function,
    forward and backward (the route auto takes on CPU: the C++ kernel, or where it cannot build,
    the fused SDPA route)."""
    out = tmp_path / "p.json"
    tool = load_dev("profile_step")
    assert tool.main(["--configs", AA_DEMO, "--size", "96", "--batch", "1", "--warmup", "0",
                      "--iters", "1", "--top", "400", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python dev/profile_step.py --configs")
    assert report["machine"]["cpu"] and report["threads"] == 1 and "commit" in report
    (r,) = report["results"]
    assert r["config"] == "configs/Demo/trees_AA_R_26_slim_FPN.yaml"
    parts = r["forward_ms"]
    assert list(parts) == [f"backbone.bottom_up.{n}" for n in ("stem", "res2", "res3", "res4", "res5")] + [
        "head", "backbone without bottom_up (FPN, P6/P7)"]
    assert sum(parts.values()) == pytest.approx(r["forward_backbone_and_head_ms"], abs=0.5)
    assert r["forward_backbone_and_head_ms"] + r["losses_backward_and_step_ms"] == pytest.approx(
        r["profiled_step_ms"], abs=0.2)
    names = [op["name"] for op in r["ops"]]
    from aadet.layers.functional.backends.cpu_kernels import KERNELS

    if KERNELS["aa"].available():
        assert "_CppRowColAttention" in names and "_CppRowColAttentionBackward" in names
    assert all(op["self_cpu_ms"] >= 0 and op["calls"] >= 1 for op in r["ops"])


def test_refuses_a_missing_config(capsys):
    with pytest.raises(SystemExit):
        load_dev("profile_step").main(["--configs", "configs/Demo/nope.yaml"])
    assert "config file not found" in capsys.readouterr().err
