"""The production-shape sweep (``dev/aadet_dev/sweep.py``) on CPU: its shapes come from building the
configs, each case checks finiteness and the float64 brute force on a sample, a case that fails only
under one SDPA backend is recorded naming that backend, and a run cut at its budget is continued by
the next without repeating a case."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from aadet.layers.functional import reference
from aadet_dev import sweep

from tests.helpers import REPO

DEMO_AA = f"{REPO}/configs/Demo/trees_AA_R_26_slim_FPN.yaml"
DEMO_SASA = f"{REPO}/configs/Demo/trees_SASA_R_26_slim_FPN.yaml"
DEMO_HALO = f"{REPO}/configs/Demo/trees_Halo_R_26_slim_FPN.yaml"
DEMO_FULL = f"{REPO}/configs/Demo/trees_SASA_full_attention_R_26_slim.yaml"


@pytest.fixture(scope="module")
def shapes():
    return sweep.collect_layers([DEMO_AA, DEMO_SASA, DEMO_HALO, DEMO_FULL], size=64)


def test_shapes_come_from_building_the_configs(shapes):
    """Every attention layer of every config is found, at the shape its forward gave it."""
    from detectron2.modeling import build_model

    from aadet.engine import load_config

    families = {s["family"] for s in shapes}
    assert families == {"aa", "sasa", "halonet", "stem"}, families
    cfg = load_config(DEMO_AA, ["MODEL.DEVICE", "cpu"])
    from aadet.layers import AugmentedConv2d

    aa_layers = [n for n, m in build_model(cfg).named_modules() if isinstance(m, AugmentedConv2d)]
    listed = [c.split(":", 1)[1] for s in shapes for c in s["configs"] if c.startswith("trees_AA_R_26_slim_FPN:")]
    assert sorted(listed) == sorted(aa_layers) and aa_layers
    # a 64 px input: the SASA demo's attention stages see 16, 8 and 4 px maps (its first layer of a
    # stage with stride 2, on the map the stage before left), from the forward itself
    sasa = {(s["input"][-1], s["stride"]) for s in shapes if s["configs"][0].startswith("trees_SASA_R_26")}
    assert sasa == {(16, 1), (16, 2), (8, 1), (8, 2), (4, 1), (4, 2)}, sasa
    for s in shapes:
        assert s["output"][0] > 0 and s["stride"] in (1, 2, 4), s.row()


def test_the_criss_cross_block_is_swept_against_its_brute_force():
    """CCNet's config: its RCCA's shared block, met twice a forward (R = 2), is one shape."""
    shapes = sweep.collect_layers([f"{REPO}/configs/COCO-Detection/ccnet_retinanet_R_50_FPN_scratch_150ep.yaml"],
                                  size=64)
    (cc,) = [s for s in shapes if s["family"] == "ccnet"]
    assert cc["input"] == cc["output"] == [256, 4, 4] and len(cc["configs"]) == 1
    row = sweep.run_case(cc, "materialized", "fp32", batch=2, device="cpu", iters=1)
    assert row["ok"] and row["error"] < 1e-5, row
    assert sweep.routes_of(cc, "cuda") == ("materialized", sweep.CONV)


def test_routes_are_the_registries_cuda_routes_and_a_conv(shapes):
    from aadet.layers.functional import LOCAL_ATTENTION_BACKENDS

    sasa = next(s for s in shapes if s["family"] == "sasa")
    routes = sweep.routes_of(sasa, "cuda")
    assert routes[-1] == sweep.CONV and "cpp" not in routes
    assert set(routes[:-1]) == {n for n, r in LOCAL_ATTENTION_BACKENDS.items() if r.cuda}
    assert "cpp" in sweep.routes_of(sasa, "cpu")


@pytest.mark.parametrize("family", ["aa", "sasa", "halonet", "stem"])
def test_each_family_agrees_with_its_brute_force(shapes, family):
    shape = next(s for s in shapes if s["family"] == family)
    route = sweep.routes_of(shape, "cpu")[0]
    row = sweep.run_case(shape, route, "fp32", batch=2, device="cpu", iters=1)
    assert row["ok"] and row["finite_output"] and row["finite_grads"], row
    assert row["error"] < 1e-5, row  # float32 on CPU against float64
    conv = sweep.run_case(shape, sweep.CONV, "fp32", batch=2, device="cpu", iters=1)
    assert conv["ok"] and "error" not in conv


def test_a_wrong_route_is_caught_by_the_sample(shapes, monkeypatch):
    """A core off by one key row at the bottom border: finite, but the sample's corners see it."""
    shape = next(s for s in shapes if s["family"] == "sasa" and s["input"][-1] >= 4)
    module = sweep._entry(shape["module"])[2]
    original = module.local_self_attention_2d_unchecked

    def off_at_border(q, k, v, *args, **kwargs):
        out = original(q, k, v, *args, **kwargs)
        return torch.cat([out[:, :, :-1], out[:, :, :1]], dim=2)  # last row replaced by the first

    monkeypatch.setattr(module, "local_self_attention_2d_unchecked", off_at_border)
    row = sweep.run_case(shape, "neighborhood", "fp32", batch=1, device="cpu", iters=1)
    assert row["finite_output"] and not row["agrees"] and not row["ok"], row


def test_every_shape_comes_in_the_targets_precisions_before_fp16(shapes):
    cases = sweep.plan_cases(shapes, "cuda")
    first_fp16 = next(n for n, (_i, _r, p) in enumerate(cases) if p == "fp16")
    assert {p for _i, _r, p in cases[:first_fp16]} == {"fp32", "bf16"}
    assert {i for i, _r, _p in cases[:first_fp16]} == set(range(len(shapes)))
    assert {p for _i, _r, p in cases[first_fp16:]} == {"fp16"}
    assert len(cases) == len(set(cases)) == sum(3 * len(sweep.routes_of(s, "cuda")) for s in shapes)


def test_routes_of_one_shape_share_one_brute_force(shapes, monkeypatch):
    """The routes of a shape and precision call the core with equal arguments: the brute force
    runs once for them, and again for other arguments; a wrong route is still caught with it."""
    shape = next(s for s in shapes if s["family"] == "sasa")
    calls = []
    brute_force = sweep._brute_force
    monkeypatch.setattr(sweep, "_brute_force", lambda *a: calls.append(1) or brute_force(*a))
    cache = sweep.ReferenceCache()
    routes = [r for r in ("neighborhood", "materialized", "fused", "cpp") if r in sweep.routes_of(shape, "cpu")]
    rows = [sweep.run_case(shape, r, "fp32", batch=1, device="cpu", iters=0, cache=cache) for r in routes]
    assert len(routes) >= 3 and len(calls) == 1 and all(r["ok"] for r in rows), rows
    sweep.run_case(shape, routes[0], "fp32", batch=1, device="cpu", iters=0, cache=cache, seed=1)
    assert len(calls) == 2  # another input: computed again

    module = sweep._entry(shape["module"])[2]
    original = module.local_self_attention_2d_unchecked
    monkeypatch.setattr(module, "local_self_attention_2d_unchecked",
                        lambda *a, **kw: original(*a, **kw).flip(2))  # rows upside down
    row = sweep.run_case(shape, routes[0], "fp32", batch=1, device="cpu", iters=0, cache=cache, seed=1)
    assert len(calls) == 2 and not row["agrees"], row


def test_reference_on_queries_is_the_full_brute_force():
    """The sampled brute force equals the full one at those pixels (float64)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 6, 4, dtype=torch.float64) for _ in range(3))
    rel_h, rel_w = torch.randn(9, 4, dtype=torch.float64), torch.randn(11, 4, dtype=torch.float64)
    queries = [(0, 0), (4, 5), (2, 3)]
    full = reference.relative_self_attention_2d_reference(q, k, v, rel_h, rel_w)
    part = reference.relative_self_attention_2d_reference(q, k, v, rel_h, rel_w, queries=queries)
    assert torch.allclose(part, torch.stack([full[:, :, y, x] for y, x in queries], 2), atol=1e-12)
    rel3 = torch.randn(3, 2, dtype=torch.float64)
    full = reference.local_self_attention_2d_reference(q, k, v, rel3, rel3, 3)
    part = reference.local_self_attention_2d_reference(q, k, v, rel3, rel3, 3, queries=queries)
    assert torch.allclose(part, torch.stack([full[:, :, y, x] for y, x in queries], 2), atol=1e-12)
    rel = torch.randn(2 * (4 + 2) - 1, 2, dtype=torch.float64)
    full = reference.halo_attention_2d_reference(q, k, v, rel, rel, 4, 1, 1)
    part = reference.halo_attention_2d_reference(q, k, v, rel, rel, 4, 1, 1, queries=queries)
    assert torch.allclose(part, torch.stack([full[:, :, y, x] for y, x in queries], 2), atol=1e-12)


def _fake_sdpa_nan_under(backend_flag):
    """An SDPA that returns NaN while only the backend whose ``torch.backends.cuda`` flag is
    ``backend_flag`` is enabled (what a kernel broken for one backend looks like), else the
    plain formula."""
    flags = ("math_sdp_enabled", "mem_efficient_sdp_enabled", "flash_sdp_enabled", "cudnn_sdp_enabled")

    def fake(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        enabled = {f for f in flags if getattr(torch.backends.cuda, f)()}
        if enabled == {backend_flag}:
            return torch.full(q.shape[:-1] + v.shape[-1:], math.nan, dtype=q.dtype)
        s = scale if scale is not None else q.shape[-1] ** -0.5
        return torch.softmax((q @ k.transpose(-1, -2)) * s, dim=-1) @ v

    return fake


def test_a_case_failing_under_one_sdpa_backend_names_it(shapes, monkeypatch, tmp_path):
    monkeypatch.setattr(F, "scaled_dot_product_attention", _fake_sdpa_nan_under("mem_efficient_sdp_enabled"))
    shape = next(s for s in shapes if s["family"] == "aa")
    ok = sweep.run_case(shape, "fused", "fp32", batch=1, device="cpu", iters=1)
    assert ok["ok"], ok  # every backend enabled: the fake computes
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
        bad = sweep.run_case(shape, "fused", "fp32", batch=1, device="cpu", iters=1)
    assert not bad["finite_output"] and not bad["ok"]
    verdict = sweep.bisect_sdpa(lambda: sweep.run_case(shape, "fused", "fp32", batch=1, device="cpu", iters=0))
    assert verdict["EFFICIENT_ATTENTION"] == "fails", verdict
    assert verdict["MATH"] == "ok" and verdict["FLASH_ATTENTION"] == "ok", verdict


def test_the_sweep_records_the_backend_in_its_row(shapes, monkeypatch, tmp_path):
    """Through run_sweep: the failing case's row carries the bisection."""
    shape = next(s for s in shapes if s["family"] == "aa")
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", _fake_sdpa_nan_under("math_sdp_enabled"))
    # every backend on: NaN only where only MATH is on -> make the default run fail too by
    # restricting the sweep's own run to MATH alone
    out = tmp_path / "sweep.jsonl"
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        sweep.run_sweep([shape], str(out), batch=1, device="cpu", iters=1, precisions=("fp32",))
    monkeypatch.setattr(F, "scaled_dot_product_attention", real)
    rows = {r["route"]: r for r in sweep.read_rows(str(out))}
    assert not rows["fused"]["ok"] and rows["fused"]["sdpa_backends"]["MATH"] == "fails", rows["fused"]
    assert rows["materialized"]["ok"] and "sdpa_backends" not in rows["materialized"]


def test_a_cut_sweep_is_continued_without_repeating(shapes, tmp_path):
    shape = next(s for s in shapes if s["family"] == "halonet")
    out = str(tmp_path / "sweep.jsonl")
    n = len(sweep.plan_cases([shape], "cpu", ("fp32",)))
    first = sweep.run_sweep([shape], out, batch=1, device="cpu", iters=1, precisions=("fp32",),
                            seconds=1e9, case_seconds=0.0)
    assert first["done"] == n and first["left"] == 0
    with open(out) as f:
        rows = [json.loads(line) for line in f]
    keep = rows[:2]
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
    cut = sweep.run_sweep([shape], out, batch=1, device="cpu", iters=1, precisions=("fp32",), seconds=0.0)
    assert cut == {"done": 0, "skipped": 2, "left": n - 2, "failed": 0}
    again = sweep.run_sweep([shape], out, batch=1, device="cpu", iters=1, precisions=("fp32",))
    assert again["done"] == n - 2 and again["skipped"] == 2
    assert sorted(r["case"] for r in sweep.read_rows(out)) == sorted(r["case"] for r in rows)
