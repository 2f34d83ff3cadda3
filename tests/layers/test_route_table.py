"""impl="auto" on CUDA reads the route table (aadet/layers/functional/route_table.py): the table's
fastest route for the GPU's compute capability, the precision and the nearest map size; the stated
default where the table has nothing for the device, or names a route that cannot take the call.
Off CUDA no table is read (the CPU rules stand). The GPU is stood in for by the capability lookup."""
import pytest
import torch

from aadet.layers.functional import route_table
from aadet.layers.functional.criss_cross import CRISS_CROSS_BACKENDS, auto_criss_cross_attention_impl
from aadet.layers.functional.dispatch import Route, RouteRegistry
from aadet.layers.functional.halo_attention import HALO_ATTENTION_BACKENDS, auto_halo_attention_impl
from aadet.layers.functional.local_attention import LOCAL_ATTENTION_BACKENDS, auto_local_attention_impl
from aadet.layers.functional.logit_tables import LOGIT_TABLE_BACKENDS, auto_logit_table_impl


def _entry(family, precision, queries, route, capability="9.0"):
    return {"family": family, "capability": capability, "precision": precision, "queries": queries,
            "route": route, "times_ms": {route: 1.0}}


TABLE = {"format": 1, "entries": [
    _entry("aa", "bf16", 400, "materialized"),
    _entry("aa", "bf16", 6400, "triton"),
    _entry("aa", "fp32", 1600, "flex"),
    _entry("sasa", "bf16", 6400, "triton"),
    _entry("sasa", "fp32", 6400, "materialized"),
    _entry("halonet", "bf16", 1600, "materialized"),
    _entry("ccnet", "fp32", 1600, "materialized"),
    _entry("aa", "bf16", 6400, "materialized", capability="8.0"),
]}


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in GPU of capability 9.0 for every tensor, with TABLE as the committed table."""
    monkeypatch.setattr(route_table, "capability", lambda device: "9.0")
    monkeypatch.setattr(route_table, "load_route_table", lambda path=None: TABLE)


def _aa_q(queries, dtype=torch.bfloat16):
    return torch.zeros(2, 8, queries, 16, dtype=dtype)  # [*, Lq, d]


def _map_q(h, w, dtype=torch.bfloat16):
    return torch.zeros(1, 8, h, w, 16, dtype=dtype)  # [B, Nh, H, W, d]


def test_auto_takes_the_table_route_of_the_nearest_map_size(gpu):
    assert auto_logit_table_impl(_aa_q(400)) == "materialized"
    assert auto_logit_table_impl(_aa_q(1000)) == "materialized"  # log scale: nearer 400 than 6400
    assert auto_logit_table_impl(_aa_q(3000)) == "triton"
    assert auto_logit_table_impl(_aa_q(100_000)) == "triton"
    assert auto_logit_table_impl(_aa_q(50, torch.float32)) == "flex"  # the precision's own entries
    assert auto_local_attention_impl(_map_q(80, 80), 7) == "triton"
    assert auto_local_attention_impl(_map_q(80, 80, torch.float32), 7) == "materialized"
    assert auto_halo_attention_impl(_map_q(40, 40)) == "materialized"
    assert auto_criss_cross_attention_impl(_map_q(40, 40, torch.float32)) == "materialized"


def test_without_an_entry_the_stated_default(gpu, monkeypatch):
    # no fp16 rows: no measured route, so the front end's default (CUDA_DEFAULT_ROUTES on a GPU)
    assert route_table.measured_route("aa", LOGIT_TABLE_BACKENDS, _aa_q(400, torch.float16), 400) is None
    assert route_table.measured_route("sasa", LOCAL_ATTENTION_BACKENDS, _map_q(80, 80, torch.float16), 6400) is None
    assert auto_logit_table_impl(_aa_q(400, torch.float64)) == "materialized"  # float64's own rule
    monkeypatch.setattr(route_table, "capability", lambda device: "10.0")  # a GPU the table lacks
    q = _aa_q(6400)
    assert route_table.measured_route("aa", LOGIT_TABLE_BACKENDS, q, 6400) is None


def test_off_cuda_no_table_is_read():
    q = _aa_q(6400)
    assert route_table.capability(q.device) is None
    assert route_table.measured_route("aa", LOGIT_TABLE_BACKENDS, q, 6400, table=TABLE) is None


def test_a_route_that_cannot_take_the_call_is_not_taken(gpu):
    def entry_for(route):
        return {"entries": [_entry("x", "bf16", 100, route)]}

    fn = CRISS_CROSS_BACKENDS["materialized"].fn
    registry = RouteRegistry("test", {
        "gpu": Route(fn, "runs on CUDA"),
        "cpu_only": Route(fn, "a CPU kernel", cuda=False),
        "needs_missing": Route(fn, "needs a module not installed", requires=("no_such_module_for_aadet",)),
        "needs_torch": Route(fn, "needs torch", requires=("torch",)),
    })
    q = _map_q(10, 10)
    assert route_table.measured_route("x", registry, q, 100, table=entry_for("gpu")) == "gpu"
    assert route_table.measured_route("x", registry, q, 100, table=entry_for("needs_torch")) == "needs_torch"
    for name in ("cpu_only", "needs_missing", "not_registered"):
        assert route_table.measured_route("x", registry, q, 100, table=entry_for(name)) is None
    # SASA asked to recompute: only a route that can
    sasa = {"entries": [_entry("sasa", "bf16", 100, "fused")]}
    assert route_table.measured_route("sasa", LOCAL_ATTENTION_BACKENDS, q, 100, table=sasa) == "fused"
    assert route_table.measured_route("sasa", LOCAL_ATTENTION_BACKENDS, q, 100, recompute=True, table=sasa) is None


def test_the_committed_table_names_registered_cuda_routes():
    registries = {"aa": LOGIT_TABLE_BACKENDS, "sasa": LOCAL_ATTENTION_BACKENDS, "halonet": HALO_ATTENTION_BACKENDS,
                  "ccnet": CRISS_CROSS_BACKENDS}
    table = route_table.load_route_table()
    assert table["entries"], "the committed table is empty"
    for e in table["entries"]:
        assert e["route"] in registries[e["family"]] and registries[e["family"]][e["route"]].cuda, e
        assert e["precision"] in route_table.PRECISIONS.values() and e["queries"] >= 1
        assert e["route"] in e["times_ms"]  # measured there (the choice's rule: dev/tests/test_route_table.py)


def test_a_layer_calling_again_costs_one_dict_lookup(gpu, monkeypatch):
    calls = []
    lookup = route_table._table_route
    monkeypatch.setattr(route_table, "_table_route", lambda *a: calls.append(a) or lookup(*a))
    q = _aa_q(1234)
    for _ in range(3):
        assert route_table.measured_route("aa", LOGIT_TABLE_BACKENDS, q, 1234) == "materialized"
    assert len(calls) == 1  # searched once a process (no other test asks for 1234 queries)
    route_table.measured_route("aa", LOGIT_TABLE_BACKENDS, q, 1234, table=TABLE)
    assert len(calls) == 2  # a table given by the caller is searched each call
