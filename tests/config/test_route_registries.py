"""The route registries are the one list of attention routes: a route registered there is at once
a valid ``impl`` of the layers and of the config keys, listed in their errors and in the
generated docs, and exportable exactly when it is flagged ``exports``."""
import pytest
import torch

from aadet.config import ConfigValueError, validate_aadet_config
from aadet.engine import get_aadet_cfg
from aadet.export import check_exportable
from aadet.layers import AugmentedConv2d, CrissCrossAttention2d, HaloSelfAttention2d, LocalSelfAttention2d
from aadet.layers.functional import (
    CRISS_CROSS_BACKENDS,
    HALO_ATTENTION_BACKENDS,
    LOCAL_ATTENTION_BACKENDS,
    LOGIT_TABLE_BACKENDS,
    Route,
)

CASES = [
    (LOGIT_TABLE_BACKENDS, "MODEL.AA.IMPL", lambda impl: AugmentedConv2d(8, 16, num_heads=2, impl=impl)),
    (LOCAL_ATTENTION_BACKENDS, "MODEL.SASA.IMPL", lambda impl: LocalSelfAttention2d(8, 16, 3, 2, impl=impl)),
    (HALO_ATTENTION_BACKENDS, "MODEL.HALO.IMPL",
     lambda impl: HaloSelfAttention2d(8, 16, block_size=2, halo_size=1, num_heads=2, impl=impl)),
    (CRISS_CROSS_BACKENDS, "MODEL.CCNET.IMPL",
     lambda impl: _gamma_one(CrissCrossAttention2d(8, num_heads=2, reduction=2, impl=impl))),
]


def _gamma_one(block):
    """A criss-cross block whose output depends on its attention (gamma starts at 0)."""
    with torch.no_grad():
        block.gamma.fill_(1.0)
    return block


@pytest.mark.parametrize("routes,key,layer", CASES, ids=["AA", "SASA", "Halo", "CCNet"])
def test_a_registered_route_appears_everywhere(routes, key, layer):
    name = "test_dummy_route"
    materialized = routes["materialized"]
    routes[name] = materialized._replace(summary="a test route", exports=True)
    try:
        with pytest.raises(ValueError, match=name):  # the layer's error lists it
            layer("no_such_route")
        torch.manual_seed(0)
        dummy = layer(name).double()
        torch.manual_seed(0)
        reference = layer("materialized").double()
        x = torch.randn(1, 8, 5, 6, dtype=torch.float64)
        assert torch.equal(dummy(x), reference(x))  # the forward dispatches to it

        cfg = get_aadet_cfg()
        cfg.merge_from_list([key, "no_such_route"])
        with pytest.raises(ConfigValueError, match=name):  # the config's error lists it
            validate_aadet_config(cfg)
        cfg.merge_from_list([key, name])
        validate_aadet_config(cfg)
        check_exportable(cfg, "torchscript")  # exports=True

        routes[name] = routes[name]._replace(exports=False)
        with pytest.raises(ConfigValueError, match=f"{key} must be one of .*to export.*'{name}'"):
            check_exportable(cfg, "torchscript")
        assert f"* ``{name}``: a test route" in routes.describe()
    finally:
        del routes[name]
    assert name not in routes.impls()


def test_route_lists():
    for routes in (LOGIT_TABLE_BACKENDS, LOCAL_ATTENTION_BACKENDS, HALO_ATTENTION_BACKENDS, CRISS_CROSS_BACKENDS):
        assert routes.impls() == ("auto",) + tuple(routes)
        assert routes.exportable() == ("auto", "materialized")
        assert all(isinstance(r, Route) and r.summary for r in routes.values())
    import aadet.layers.functional.criss_cross as ccnet
    import aadet.layers.functional.halo_attention as halo
    import aadet.layers.functional.local_attention as sasa
    import aadet.layers.functional.logit_tables as aa

    assert LOCAL_ATTENTION_BACKENDS.describe() in sasa.__doc__
    assert LOGIT_TABLE_BACKENDS.describe() in aa.__doc__
    assert HALO_ATTENTION_BACKENDS.describe() in halo.__doc__
    assert CRISS_CROSS_BACKENDS.describe() in ccnet.__doc__
