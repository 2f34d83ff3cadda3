"""Attention statistics (aadet.analysis.attention_stats, aadet.engine.hooks.AttentionStatsHook):
perplexity against uniform / one-hot attention, exact subsampling, grad/weight ratios by hand,
the hook writing into Detectron2's event storage, and the config key."""
import itertools
import math

import pytest
import torch
from detectron2.engine import SimpleTrainer, hooks
from torch import nn

from aadet.analysis import (
    AttentionStatsCollector,
    attention_perplexity,
    augmented_attention_perplexity,
    halo_attention_perplexity,
    local_attention_perplexity,
    relative_embedding_grad_ratios,
    stem_attention_perplexity,
)
from aadet.config import ConfigValueError, validate_aadet_config
from aadet.engine import AttentionStatsHook, get_aadet_cfg
from aadet.layers import AugmentedConv2d, HaloSelfAttention2d, LocalSelfAttention2d, SpatiallyAwareAttentionStem
from aadet.layers.functional import halo_attention_probs_2d, local_attention_probs_2d


def _sasa(kernel_size=3, positional_encoding="relative"):
    torch.manual_seed(0)
    return LocalSelfAttention2d(
        4, 8, kernel_size=kernel_size, num_heads=2, positional_encoding=positional_encoding
    )


def _zero_queries(module):
    with torch.no_grad():
        module.query.weight.zero_()


@pytest.mark.parametrize(
    "hw,kernel_size,keys",
    [
        ((2, 2), 3, 4.0),  # every pixel a corner: (r + 1)^2
        ((3, 3), 3, (4 * 4 + 4 * 6 + 9) / 9),  # corners 4, edges 6, interior k^2 = 9
        ((1, 1), 5, 1.0),
        ((9, 8), 5, (sum(min(y + 2, 8) - max(y - 2, 0) + 1 for y in range(9)) / 9)
         * (sum(min(x + 2, 7) - max(x - 2, 0) + 1 for x in range(8)) / 8)),
    ],
)
@pytest.mark.parametrize("pe", ["relative", "sine2d"])
def test_zero_queries_give_uniform_attention_over_the_in_map_keys(hw, kernel_size, keys, pe):
    m = _sasa(kernel_size, pe)
    _zero_queries(m)  # q = 0: every logit (content and relative) is 0
    st = local_attention_perplexity(m, torch.randn(2, 4, *hw))
    assert st.keys == pytest.approx(keys, rel=1e-12)
    assert st.perplexity == pytest.approx(keys, rel=1e-5)
    assert st.queries == hw[0] * hw[1]


def test_huge_queries_attend_to_about_one_key():
    m = _sasa(3)
    x = torch.randn(1, 4, 6, 6)
    base = local_attention_perplexity(m, x)
    with torch.no_grad():
        m.query.weight.mul_(1e4)
    sharp = local_attention_perplexity(m, x)
    assert 1.0 <= sharp.perplexity < 1.2 < base.perplexity < base.keys
    assert sharp.keys == base.keys == pytest.approx((16 / 6) ** 2)


def test_row_subsampling_is_exact():
    m = _sasa(5)
    x = torch.randn(2, 4, 10, 7)
    sub = local_attention_perplexity(m, x, max_queries=3 * 7)  # 3 of 10 rows
    q, k = m.queries_keys(x)
    with torch.no_grad():
        p = local_attention_probs_2d(q, k, m.rel_h, m.rel_w, 5)  # [B, Nh, H, W, k, k]
    per_query = torch.special.entr(p).sum((-2, -1)).exp()
    rows = [1, 5, 8]  # centres of 3 equal strata of 10 rows
    assert sub.queries == 3 * 7
    assert sub.perplexity == pytest.approx(float(per_query[:, :, rows].mean()), rel=1e-5)
    assert sub.keys == pytest.approx((4 + 5 + 4) / 3 * (3 + 4 + 5 + 5 + 5 + 4 + 3) / 7)


def test_augmented_conv_and_stem_perplexity():
    torch.manual_seed(0)
    aa = AugmentedConv2d(4, 16, dk=8, dv=8, num_heads=2, max_size=8)
    x = torch.randn(1, 4, 5, 6)
    full = augmented_attention_perplexity(aa, x)
    assert full.keys == 30 and full.queries == 30 and 1 < full.perplexity < 30
    assert augmented_attention_perplexity(aa, x, max_queries=7).queries == 7
    with torch.no_grad():  # zero query rows (k | q | v) and their bias: uniform over the grid
        aa.qkv.weight[8:16].zero_()
        aa.qkv.bias[8:16].zero_()
    assert attention_perplexity(aa, x).perplexity == pytest.approx(30, rel=1e-5)

    stem = SpatiallyAwareAttentionStem(3, 8, block_size=4, num_heads=2, norm="")
    _zero_queries(stem)
    x = torch.randn(2, 3, 9, 10)  # blocks of 4x4, 4x2, 1x4, 1x2 in-map pixels
    st = stem_attention_perplexity(stem, x)
    keys = (4 * 16 * 16 + 2 * 8 * 8 + 2 * 4 * 4 + 1 * 2 * 2) / 90
    assert st.queries == 90 and st.keys == pytest.approx(keys)
    assert st.perplexity == pytest.approx(keys, rel=1e-5)
    sub = stem_attention_perplexity(stem, x, max_queries=32)  # 2 of 9 blocks per image
    assert sub.queries <= 32 and sub.perplexity == pytest.approx(sub.keys, rel=1e-5)


def _halo(stride=1):
    torch.manual_seed(0)
    return HaloSelfAttention2d(4, 8, block_size=4, halo_size=1, num_heads=2, stride=stride)


@pytest.mark.parametrize("stride", [1, 2])
def test_halo_zero_queries_give_uniform_attention_over_the_in_map_window(stride):
    m = _halo(stride)
    _zero_queries(m)
    x = torch.randn(2, 4, 9, 6)  # block rows 0-3, 4-7, 8; windows clipped to the map
    st = halo_attention_perplexity(m, x)
    rows = {0: 5, 4: 6, 8: 2}  # in-map window rows of a query whose block starts at that row
    cols = {0: 5, 4: 3}
    ho, wo = -(-9 // stride), -(-6 // stride)
    keys = sum(rows[stride * y // 4 * 4] * cols[stride * x // 4 * 4] for y in range(ho) for x in range(wo))
    assert st.queries == ho * wo and st.keys == pytest.approx(keys / (ho * wo), rel=1e-12)
    assert st.perplexity == pytest.approx(st.keys, rel=1e-5)
    assert attention_perplexity(m, x) == st


@pytest.mark.parametrize("stride", [1, 2])
def test_halo_row_subsampling_is_exact(stride):
    m = _halo(stride)
    x = torch.randn(2, 4, 19, 7)
    q, k = m.queries_keys(x)
    with torch.no_grad():
        p = halo_attention_probs_2d(q, k, m.rel_h, m.rel_w, 4, 1, query_stride=stride)
    per_query = torch.special.entr(p).sum((-2, -1)).exp()  # [B, Nh, Ho, Wo]
    ho, wo = per_query.shape[2:]
    full = halo_attention_perplexity(m, x)
    assert full.perplexity == pytest.approx(float(per_query.mean()), rel=1e-6)
    assert 1 < full.perplexity < full.keys
    sub = halo_attention_perplexity(m, x, max_queries=3 * wo)  # 3 rows, each on its own band
    rows = ((torch.arange(3, dtype=torch.float64) + 0.5) * (ho / 3)).floor().long()
    assert sub.queries == 3 * wo
    assert sub.perplexity == pytest.approx(float(per_query[:, :, rows].mean()), rel=1e-6)


def test_grad_ratios_by_hand():
    m = _sasa(3)
    net = nn.Sequential(m)
    m.rel_h.grad = torch.full_like(m.rel_h, 0.5)
    m.rel_w.grad = torch.zeros_like(m.rel_w)
    m.rel_w.grad[1] = 2.0  # only row (offset) 1 received gradient
    m.value.weight.grad = 3.0 * torch.ones_like(m.value.weight)
    r = relative_embedding_grad_ratios(net)
    rh, rw = m.rel_h.detach().double(), m.rel_w.detach().double()
    g_h, g_w = 0.5 ** 2 * rh.numel(), 2.0 ** 2 * rw.shape[1]
    assert r["0/rel_h"] == pytest.approx(math.sqrt(g_h) / float(rh.norm()))
    assert r["0/rel_w"] == pytest.approx(math.sqrt(g_w) / float(rw[1].norm()))
    assert r["0/rel"] == pytest.approx(
        math.sqrt((g_h + g_w) / (float(rh.square().sum()) + float(rw[1].square().sum())))
    )
    w = m.value.weight.detach().double()
    assert r["0/value"] == pytest.approx(3.0 * math.sqrt(w.numel()) / float(w.norm()))
    assert "0/query" not in r  # no .grad: left out

    aa = AugmentedConv2d(4, 16, dk=8, dv=8, num_heads=2, max_size=8)
    aa.qkv.weight.grad = torch.zeros_like(aa.qkv.weight)
    aa.qkv.weight.grad[16:24] = 1.0  # the value rows (k | q | v)
    r = relative_embedding_grad_ratios(nn.Sequential(aa))
    wv = aa.qkv.weight.detach()[16:24].double()
    assert r["0/value"] == pytest.approx(math.sqrt(wv.numel()) / float(wv.norm()))
    assert r["0/query"] == 0.0


def test_collector_measures_each_layer_at_its_first_call():
    m = _sasa(3)
    net = nn.Sequential(nn.Conv2d(4, 4, 1), m)
    x1, x2 = torch.randn(2, 4, 6, 6), torch.randn(1, 4, 6, 6)
    with AttentionStatsCollector(net) as c:
        net(x1)
        net(x2)  # a second call (e.g. an evaluation forward) does not replace it
    assert list(c.stats) == ["1"] and not c.active
    expected = local_attention_perplexity(m, net[0](x1[:1]))
    assert c.stats["1"].perplexity == pytest.approx(expected.perplexity, rel=1e-6)
    net(x1)  # hooks removed
    assert list(c.stats) == ["1"]


class _TinyModel(nn.Module):
    def __init__(self, attention=True):
        super().__init__()
        torch.manual_seed(0)
        self.attn = LocalSelfAttention2d(2, 4, kernel_size=3, num_heads=2) if attention else nn.Conv2d(2, 4, 3)

    def forward(self, x):
        return {"loss": self.attn(x).square().mean()}


def _train(model, period, max_iter):
    data = itertools.repeat(torch.randn(2, 2, 5, 5))
    trainer = SimpleTrainer(model, data, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.register_hooks([AttentionStatsHook(period)])
    trainer.train(0, max_iter)
    return trainer.storage


def test_hook_writes_scalars_every_period_and_at_the_last_iteration():
    storage = _train(_TinyModel(), period=2, max_iter=3)  # due: iteration 1 (2nd) and 2 (last)
    names = {n for n in storage.histories() if n.startswith("attn/")}
    assert names == {
        f"attn/attn/{s}" for s in ("perplexity", "keys", "rel_h_grad_ratio", "rel_w_grad_ratio",
                                   "rel_grad_ratio", "query_grad_ratio", "value_grad_ratio")
    }
    for name in names:
        values = storage.history(name).values()
        assert [it for _, it in values] == [1, 2], name
        assert all(math.isfinite(v) and v > 0 for v, _ in values), (name, values)
    assert all(v == pytest.approx(169 / 25) for v, _ in storage.history("attn/attn/keys").values())  # (13/5)^2
    assert all(1 <= v <= 169 / 25 + 1e-6 for v, _ in storage.history("attn/attn/perplexity").values())


def test_hook_is_a_no_op_without_attention_layers():
    storage = _train(_TinyModel(attention=False), period=1, max_iter=2)
    assert not [n for n in storage.histories() if n.startswith("attn/")]


def test_trainer_adds_the_hook_before_the_writer(hooks_trainer):
    cfg = get_aadet_cfg()
    cfg.TEST.EVAL_PERIOD, cfg.TEST.ATTENTION_STATS_PERIOD = 0, 5
    trainer = hooks_trainer(cfg, nn.Linear(1, 1))
    kinds = [type(h) for h in trainer.build_hooks()]
    assert kinds.index(AttentionStatsHook) == kinds.index(hooks.PeriodicWriter) - 1
    cfg.TEST.ATTENTION_STATS_PERIOD = 0
    assert AttentionStatsHook not in [type(h) for h in trainer.build_hooks()]


def test_config_key_default_off_and_negative_rejected():
    cfg = get_aadet_cfg()
    assert cfg.TEST.ATTENTION_STATS_PERIOD == 0
    validate_aadet_config(cfg)
    cfg.TEST.ATTENTION_STATS_PERIOD = -1
    with pytest.raises(ConfigValueError, match=r"TEST\.ATTENTION_STATS_PERIOD must be >= 0.*-1"):
        validate_aadet_config(cfg)
