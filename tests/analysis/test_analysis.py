"""Model analysis (``aadet.analysis``): exact parameter counts of every COCO config, FLOP counting
that includes attention (hand counts on tiny inputs)."""

import glob
import os

import pytest
import torch
import torch.nn.functional as F
from detectron2.modeling import build_model
from torch import nn

from aadet.analysis import attention_flops, count_flops, parameter_breakdown
from aadet.engine import load_config
from aadet.layers import (
    AugmentedConv2d,
    CrissCrossAttention2d,
    HaloSelfAttention2d,
    LocalSelfAttention2d,
    SpatiallyAwareAttentionStem,
)

from tests.helpers import REPO


# Exact parameter counts (total, bottom-up, FPN, head) of every COCO config, committed: an
# accidental architecture change fails here loudly. Update deliberately, with `make docs` (the
# model table counts them again).
COCO_PARAMS = {
    "aa_retinanet_R_101_FPN_scratch_150ep": (52029882, 41692358, 3870208, 6467316),
    "aa_retinanet_R_50_FPN_scratch_150ep": (33417398, 23079874, 3870208, 6467316),
    "aa_retinanet_R_50_FPN_scratch_150ep_pos_coordconv": (33405524, 23068000, 3870208, 6467316),
    "aa_retinanet_R_50_FPN_scratch_150ep_pos_none": (33400292, 23062768, 3870208, 6467316),
    "aa_retinanet_R_50_FPN_scratch_150ep_pos_sine2d": (33400292, 23062768, 3870208, 6467316),
    # SASA conv stem's placement, tables of 21 rows instead of 7: + 6,608 (tests/modeling/test_halo_models.py)
    # the conv R50's + one RCCA in res4 (C = 1024, inter 256): conva 3x3 2,359,296 + BN 512, the
    # block's q, k (256 -> 32, bias) 2 x 8,224 + v (256 -> 256, bias) 65,792 + gamma 1, convb 3x3
    # 589,824 + BN 512, bottleneck 3x3 (1280 -> 1024) 11,796,480 + BN 2,048 = 14,830,913
    "ccnet_retinanet_R_50_FPN_scratch_150ep": (48676469, 38338945, 3870208, 6467316),
    "halo_retinanet_R_50_FPN_scratch_150ep": (26310636, 15973112, 3870208, 6467316),
    "retinanet_R_101_FPN_scratch_150ep": (52837684, 42500160, 3870208, 6467316),
    "retinanet_R_50_FPN_scratch_150ep": (33845556, 23508032, 3870208, 6467316),
    "sasa_attnstem_retinanet_R_50_FPN_scratch_150ep": (26296988, 15959464, 3870208, 6467316),
    "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep": (
        21974076,
        15959464,
        2691232,
        3323380,
    ),
    "sasa_convstem_retinanet_R_50_FPN_scratch_150ep": (26304028, 15966504, 3870208, 6467316),
    "sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep": (
        21981116,
        15966504,
        2691232,
        3323380,
    ),
}
COCO_CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "COCO-Detection", "*.yaml")))


def _name(path):
    return os.path.splitext(os.path.basename(path))[0]


# ----------------------------------------------------------------------------- parameters
def test_every_coco_config_has_committed_counts():
    names = {_name(c) for c in COCO_CONFIGS}
    assert names == set(COCO_PARAMS), (
        f"configs without committed parameter counts: {sorted(names - set(COCO_PARAMS))}; "
        f"counts without a config: {sorted(set(COCO_PARAMS) - names)}"
    )


@pytest.mark.parametrize("config", COCO_CONFIGS, ids=_name)
def test_coco_parameter_counts_exact(config):
    torch.manual_seed(0)
    p = parameter_breakdown(build_model(load_config(config, ["MODEL.DEVICE", "cpu"])))
    got = (p["total"], p["backbone"], p["fpn"], p["head"])
    assert (
        got == COCO_PARAMS[_name(config)]
    ), f"{_name(config)}: (total, backbone, fpn, head) = {got}"
    assert p["other"] == 0


def test_parameter_breakdown_sums():
    model = nn.Module()
    model.backbone = nn.Module()
    model.backbone.bottom_up = nn.Linear(3, 4)  # 16
    model.backbone.lateral = nn.Linear(4, 4)  # 20
    model.head = nn.Conv2d(4, 2, 1)  # 10
    assert parameter_breakdown(model) == {
        "backbone": 16,
        "fpn": 20,
        "head": 10,
        "other": 0,
        "total": 46,
    }


# ----------------------------------------------------------------------------- FLOPs
def test_sasa_layer_flops_match_hand_count():
    b, cin, c, h, w, k = 2, 12, 16, 5, 6, 3
    layer = LocalSelfAttention2d(cin, c, kernel_size=k, num_heads=2, block_size=4).eval()
    report = count_flops(layer, torch.randn(b, cin, h, w))
    n = h * w
    projections = 3 * b * n * cin * c  # q, k, v 1x1 convs (fvcore)
    attention = b * (n * k * k * c + n * k * c + n * k * k * c)  # content + relative + weighted sum
    assert report.attention == attention > 0
    assert report.total == projections + attention
    assert report.unsupported_ops == {}
    assert report.overhead > 0  # 4x4 tiles with 6x6 halo windows score more keys than 3x3


def test_sasa_strided_layer_counts_queries_at_input_resolution():
    layer = LocalSelfAttention2d(
        8, 8, kernel_size=5, num_heads=2, stride=2, positional_encoding="none"
    )
    report = count_flops(layer.eval(), torch.randn(1, 8, 7, 7))
    n = 49
    assert report.total == 3 * n * 8 * 8 + 2 * n * 25 * 8  # pooling not counted


def test_halo_layer_flops_match_hand_count():
    """Queries on the strided grid (q projection too), keys and values at full resolution, each
    query against its block's whole (b + 2h)^2 window."""
    b, cin, c, h, w, bs, hs = 2, 12, 16, 9, 7, 4, 1
    layer = HaloSelfAttention2d(cin, c, block_size=bs, halo_size=hs, num_heads=2, stride=2).eval()
    report = count_flops(layer, torch.randn(b, cin, h, w))
    n, nq, u = h * w, 5 * 4, bs + 2 * hs
    projections = b * (nq + 2 * n) * cin * c
    attention = b * nq * c * (2 * u * u + u)  # content + weighted sum + relative
    assert report.attention == attention > 0
    assert report.total == projections + attention
    assert report.unsupported_ops == {}
    assert report.overhead == b * nq * c * (2 * (bs + hs) - 1 - u)  # all 9 offsets' tables vs 6


def test_criss_cross_block_flops_match_hand_count():
    """Each pixel against the H + W - 1 pixels of its column and row (itself once); the
    materialized route's own count scores the pixel twice (the overhead)."""
    b, c, h, w, reduction = 2, 16, 5, 7, 4
    layer = CrissCrossAttention2d(c, num_heads=2, reduction=reduction).eval()
    report = count_flops(layer, torch.randn(b, c, h, w))
    n, d, keys = h * w, c // reduction, h + w - 1
    projections = b * n * c * (2 * d + c)  # q, k, v 1x1 convs (fvcore)
    attention = b * n * keys * (d + c)
    assert report.attention == attention > 0
    assert report.total == projections + attention
    assert report.unsupported_ops == {}
    assert report.overhead == b * n * (d + c)  # the pixel scored by its column and its row


def test_aa_layer_flops_match_hand_count():
    b, fin, fout, h, w, dk, dv = 2, 8, 16, 6, 5, 8, 4
    layer = AugmentedConv2d(fin, fout, 3, dk=dk, dv=dv, num_heads=2, max_size=8).eval()
    report = count_flops(layer, torch.randn(b, fin, h, w))
    n = h * w
    conv = b * n * (fout - dv) * fin * 9
    qkv = b * n * fin * (2 * dk + dv)
    proj = b * n * dv * dv
    attention = b * (n * n * dk + n * (h + w) * dk + n * n * dv)
    assert report.attention == attention
    assert report.total == conv + qkv + proj + attention
    assert report.unsupported_ops == {}


def test_aa_strided_downsampled_layer_counts_the_attention_grid():
    layer = AugmentedConv2d(
        8,
        16,
        3,
        stride=2,
        dk=8,
        dv=8,
        num_heads=2,
        attention_downsample=True,
        positional_encoding="none",
    ).eval()
    x = torch.randn(1, 8, 11, 9)  # conv output 6x5, attention on 3x3
    report = count_flops(layer, x)
    ho, wo, n = 6, 5, 9
    expected = ho * wo * 8 * 8 * 9 + n * 8 * (2 * 8 + 8) + n * 8 * 8 + n * n * (8 + 8)
    assert report.total == expected
    assert attention_flops(layer, x.shape)["total"] == n * n * 16


def test_attention_stem_flops_match_hand_count():
    b, cin, c, s, m, h, w = 1, 3, 8, 4, 2, 8, 8
    stem = SpatiallyAwareAttentionStem(
        cin, c, block_size=s, num_heads=1, num_mixtures=m, norm=""
    ).eval()
    report = count_flops(stem, torch.randn(b, cin, h, w))
    n = h * w
    projections = 3 * n * cin * c  # q, k and the mixed value matrix per pixel
    attention = projections + s * s * m * c * cin + n * s * s * c + n * s * c + n * s * s * c
    assert report.attention == attention
    assert report.total == attention  # the stem calls no child convolution
    assert attention == stem.flop_count((h, w))["total"]


class _SDPA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_sdpa_outside_attention_layers_is_counted():
    q, k, v = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 5)
    report = count_flops(_SDPA(), (q, k, v))
    assert report.total == 2 * 3 * 10 * 7 * (4 + 5)


class _Uncountable(nn.Module):
    def forward(self, x):
        return torch.logsumexp(x, dim=-1)


def test_ops_fvcore_cannot_count_are_reported():
    report = count_flops(_Uncountable(), torch.randn(2, 3))
    assert report.unsupported_ops == {"aten::logsumexp": 1}


def test_shared_layer_counts_every_call():
    layer = LocalSelfAttention2d(8, 8, kernel_size=3, num_heads=2)

    class TwoCalls(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = layer

        def forward(self, a, b):
            return self.attn(a).sum() + self.attn(b).sum()

    one = count_flops(layer.eval(), torch.randn(1, 8, 4, 4)).total
    two = count_flops(TwoCalls().eval(), (torch.randn(1, 8, 4, 4), torch.randn(1, 8, 4, 4))).total
    assert two == 2 * one
