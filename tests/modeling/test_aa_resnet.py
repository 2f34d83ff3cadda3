"""Tests of the AA-ResNet backbones (AA paper, Section 4.2, Table 2)."""
import math

import pytest
import torch
from detectron2.config import get_cfg
from detectron2.layers import FrozenBatchNorm2d, ShapeSpec
from detectron2.modeling import BACKBONE_REGISTRY, build_backbone

from aadet import add_aadet_config
from aadet.config import ConfigValueError
from aadet.layers.augmented_conv import AugmentedConv2d, attention_depth
from aadet.modeling.backbone import aa_resnet  # noqa: F401  (registers the builders)
from tests.helpers import REPO
from aadet.modeling.backbone.aa_resnet import AABasicBlock, AABottleneckBlock, AugmentedConv2dNorm


def make_cfg(depth=50, aa=True, **aa_keys):
    cfg = get_cfg()
    add_aadet_config(cfg)
    cfg.MODEL.BACKBONE.NAME = "build_aa_resnet_backbone" if aa else "build_resnet_backbone"
    cfg.MODEL.RESNETS.DEPTH = depth
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res2", "res3", "res4", "res5"]
    cfg.MODEL.RESNETS.NORM = "BN"
    cfg.MODEL.RESNETS.STRIDE_IN_1X1 = False
    cfg.MODEL.BACKBONE.FREEZE_AT = 0
    if depth < 50:
        cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 64
    for k, v in aa_keys.items():
        setattr(cfg.MODEL.AA, k, v)
    return cfg


def n_params(m, pred=lambda name: True):
    return sum(p.numel() for name, p in m.named_parameters() if pred(name))


def is_table(name):
    return name.endswith("rel_h") or name.endswith("rel_w")


def augmented_layers(backbone):
    return {n: m for n, m in backbone.named_modules() if isinstance(m, AugmentedConv2d)}


# ----------------------------------------------------------------------------- parameters
@pytest.fixture(scope="module")
def r50_params():
    torch.manual_seed(0)
    return n_params(build_backbone(make_cfg(50, aa=False)))


def test_aa_r50_structure_and_parameter_delta(r50_params):
    """AA-ResNet-50 vs ResNet-50 backbones (no classifier) for 224x224 inputs.

    Paper (Table 2, with the 2.05M-parameter classifier): ResNet-50 25.6M, AA-ResNet-50 25.8M,
    i.e. +0.2M. Relative tables for MAX_INPUT_SIZE = 224 (ImageNet): res3 28 -> 14 (attention
    downsampled), res4 14, res5 7.

    Measured: ResNet-50 backbone 23,508,032. AA-ResNet-50 with the documented rounding
    (kappa = 2 nu = 0.2, Nh = 8): 23,066,374, delta -441,658 (of which tables +3,606): the
    paper's Eq. (4) predicts a *decrease* (-0.39 Fin Fout per layer). With a minimum of 20 key
    dimensions per head (as the paper states for its CIFAR models; MODEL.AA.MIN_DK_PER_HEAD):
    23,733,256, delta +225,224 (tables +12,360): the paper's +0.2M, and its Table 9 per-layer
    attention parameter counts (43k / 90k / 190k), are reproduced only with that minimum.
    """
    torch.manual_seed(0)
    aa = build_backbone(make_cfg(50, MAX_INPUT_SIZE=224))
    layers = augmented_layers(aa)
    assert len(layers) == 4 + 6 + 3  # every block of res3, res4, res5
    assert all(isinstance(b, AABottleneckBlock) for s in ("res3", "res4", "res5")
               for b in getattr(aa, s))
    assert not any(isinstance(b, AABottleneckBlock) for b in aa.res2)
    expected = {  # stage: (Fout, dk, dv, max_size, downsample)
        "res3": (128, 24, 16, 14, True),
        "res4": (256, 48, 24, 14, False),
        "res5": (512, 104, 48, 7, False),
    }
    for name, m in layers.items():
        fout, dk, dv, lmax, ds = expected[name.split(".")[0]]
        got = (m.out_channels, m.dk, m.dv, m.max_size, m.attention_downsample)
        assert got == (fout, dk, dv, lmax, ds), name
        assert m.num_heads == 8 and m.positional_encoding == "relative"
        assert isinstance(m, AugmentedConv2dNorm) and isinstance(m.norm, torch.nn.BatchNorm2d)

    total = n_params(aa)
    tables = n_params(aa, is_table)
    delta = total - r50_params
    # Exact: per augmented layer, Eq. (4) + qkv/proj biases + tables.
    eq4 = 0
    for m in layers.values():
        f = m.out_channels
        eq4 += f * (2 * m.dk + m.dv) + m.dv * m.dv - f * m.dv * 9 + (2 * m.dk + m.dv) + m.dv
    assert r50_params == 23_508_032
    assert tables == 4 * 2 * 27 * 3 + 6 * 2 * 27 * 6 + 3 * 2 * 13 * 13 == 3_606
    assert delta == eq4 + tables == -441_658
    print(f"\nR50 {r50_params:,}  AA-R50 {total:,}  delta {delta:+,} (tables {tables:,})")

    # With the paper's minimum of 20 key dims per head, the delta matches Table 2's +0.2M
    # within 2% of the ResNet-50 total (in fact within 0.05M).
    torch.manual_seed(0)
    aa20 = build_backbone(make_cfg(50, MAX_INPUT_SIZE=224, MIN_DK_PER_HEAD=20))
    delta20, tables20 = n_params(aa20) - r50_params, n_params(aa20, is_table)
    print(f"AA-R50 (dk/Nh >= 20) {n_params(aa20):,}  delta {delta20:+,} (tables {tables20:,})")
    assert (delta20, tables20) == (225_224, 12_360)
    paper_delta, paper_r50 = 25.8e6 - 25.6e6, 25.6e6
    assert abs((delta20 - tables20) - paper_delta) <= 0.02 * paper_r50
    assert abs(delta20 - paper_delta) <= 0.05e6
    # Paper Table 9 (attention parameters per layer: 43k, 90k, 190k in res3/4/5):
    for name, m in augmented_layers(aa20).items():
        attn = n_params(m.qkv) + n_params(m.proj) + n_params(m, is_table)
        paper = {"res3": 43e3, "res4": 90e3, "res5": 190e3}[name.split(".")[0]]
        assert abs(attn - paper) / paper < 0.04, (name, attn)  # 44.7k / 90.1k / 191.7k
    # The defaults are 2.7% of ResNet-50 away from the paper's count: documented, not hidden.
    assert abs(delta - paper_delta) / paper_r50 == pytest.approx(0.0251, abs=1e-3)


def test_aa_r34_parameter_delta():
    """AA-ResNet-34 (kappa = nu = 0.25, first 3x3 of each BasicBlock augmented).

    Paper Table 2: 21.8M -> 20.7M (-1.1M). Measured (backbones): ResNet-34 21,284,672; delta
    -1,523,616 with the default rounding, -1,046,648 with dk/Nh >= 20 (augmenting conv2
    instead would give -1.25M: the paper's count points at conv1).
    """
    torch.manual_seed(0)
    r34 = n_params(build_backbone(make_cfg(34, aa=False)))
    aa = build_backbone(make_cfg(34, KAPPA=0.25, NU=0.25, MAX_INPUT_SIZE=224))
    aa20 = build_backbone(make_cfg(34, KAPPA=0.25, NU=0.25, MAX_INPUT_SIZE=224, MIN_DK_PER_HEAD=20))
    assert r34 == 21_284_672
    assert all(isinstance(b, AABasicBlock) and isinstance(b.conv1, AugmentedConv2dNorm)
               and not isinstance(b.conv2, AugmentedConv2d) for b in aa.res4)
    assert n_params(aa) - r34 == -1_523_616
    assert n_params(aa20) - r34 == -1_046_648
    assert abs((n_params(aa20) - r34) - (20.7e6 - 21.8e6)) <= 0.1e6
    first = aa.res3[0].conv1
    got = (first.in_channels, first.out_channels, first.stride, first.dk, first.dv)
    assert got == (64, 128, 2, 32, 32)


# ----------------------------------------------------------------------------- forward
def test_aa_r18_forward_backward_non_square():
    torch.manual_seed(0)
    cfg = make_cfg(18, MAX_INPUT_SIZE=160)
    backbone = build_backbone(cfg)
    x = torch.randn(1, 3, 96, 160)
    out = backbone(x)
    shapes = {k: tuple(v.shape) for k, v in out.items()}
    assert shapes == {"res2": (1, 64, 24, 40), "res3": (1, 128, 12, 20),
                      "res4": (1, 256, 6, 10), "res5": (1, 512, 3, 5)}
    assert {k: (s.channels, s.stride) for k, s in backbone.output_shape().items()} == {
        "res2": (64, 4), "res3": (128, 8), "res4": (256, 16), "res5": (512, 32)}
    assert [m.max_size for m in augmented_layers(backbone).values()] == [10, 10, 10, 10, 5, 5]
    loss = sum(v.square().mean() for v in out.values())
    loss.backward()
    for name, p in backbone.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for name, m in augmented_layers(backbone).items():
        assert m.rel_h.grad.abs().sum() > 0 and m.qkv.weight.grad.abs().sum() > 0, name


def test_max_input_size_error_and_clipping():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 96)
    small = build_backbone(make_cfg(18, MAX_INPUT_SIZE=64))  # res3 attention: 8 -> 4 (downsampled)
    pattern = r"4x6 is larger than the layer's max_size=4.*MODEL.AA.MAX_INPUT_SIZE"
    with pytest.raises(ValueError, match=pattern):
        small(x)
    clipped = build_backbone(make_cfg(18, MAX_INPUT_SIZE=64, CLIP_DISTANCES=True))
    assert all(torch.isfinite(v).all() for v in clipped(x).values())


@pytest.mark.parametrize("pe", ["none", "sine2d", "coordconv"])
def test_positional_options_build_and_run(pe):
    torch.manual_seed(0)
    cfg = make_cfg(18, POSITIONAL_ENCODING=pe, STAGES=("res4", "res5"), DOWNSAMPLE_STAGES=())
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res4", "res5"]
    backbone = build_backbone(cfg)
    layers = augmented_layers(backbone)
    assert len(layers) == 4 and all(m.positional_encoding == pe for m in layers.values())
    assert all(not m.attention_downsample for m in layers.values())
    out = backbone(torch.randn(2, 3, 64, 32))
    assert out["res5"].shape == (2, 512, 2, 1)


# ----------------------------------------------------------------------------- config keys
def test_resnet_keys_are_respected():
    torch.manual_seed(0)
    cfg = make_cfg(50, STAGES=("res2", "res5"), DOWNSAMPLE_STAGES=("res2",), MAX_INPUT_SIZE=200)
    cfg.MODEL.RESNETS.STRIDE_IN_1X1 = True
    cfg.MODEL.RESNETS.NUM_GROUPS = 8
    cfg.MODEL.RESNETS.WIDTH_PER_GROUP = 16
    cfg.MODEL.RESNETS.RES5_DILATION = 2
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res3", "res5"]
    cfg.MODEL.BACKBONE.FREEZE_AT = 2
    cfg.MODEL.AA.NUM_HEADS = 16
    backbone = build_backbone(cfg)
    assert {k: (s.channels, s.stride) for k, s in backbone.output_shape().items()} == {
        "res3": (512, 8), "res5": (2048, 16)}
    res2 = backbone.res2[0].conv2
    assert isinstance(res2, AugmentedConv2dNorm) and res2.stride == 1  # STRIDE_IN_1X1
    assert res2.conv.groups == 8 and res2.num_heads == 16
    assert res2.max_size == math.ceil(math.ceil(200 / 4) / 2) == 25 and res2.attention_downsample
    assert isinstance(res2.norm, FrozenBatchNorm2d)  # FREEZE_AT = 2 freezes res2
    assert not any(p.requires_grad for p in backbone.res2.parameters())
    res5 = backbone.res5[0].conv2
    assert res5.dilation == 2 and res5.stride == 1 and res5.max_size == math.ceil(200 / 16)
    assert res5.out_channels == 1024 and res5.dv == attention_depth(0.1, 1024, 16)
    plain = [b for s in ("res3", "res4") for b in getattr(backbone, s)]
    assert not any(isinstance(b, AABottleneckBlock) for b in plain)
    assert all(p.requires_grad for p in backbone.res5.parameters())
    out = backbone(torch.randn(1, 3, 64, 48))
    assert out["res5"].shape == (1, 2048, 4, 3)


@pytest.mark.parametrize(
    "setup,pattern",
    [
        (lambda c: setattr(c.MODEL.RESNETS, "DEFORM_ON_PER_STAGE", [False, True, False, False]),
         "MODEL.RESNETS.DEFORM_ON_PER_STAGE must be all False"),
        (lambda c: setattr(c.MODEL.RESNETS, "DEPTH", 27), "MODEL.RESNETS.DEPTH must be one of"),
        (lambda c: setattr(c.MODEL.AA, "STAGES", ("res6",)), "MODEL.AA.STAGES must be a subset"),
        (lambda c: setattr(c.MODEL.AA, "DOWNSAMPLE_STAGES", ("stem",)),
         "MODEL.AA.DOWNSAMPLE_STAGES must be a subset"),
    ],
)
def test_config_errors_name_the_key(setup, pattern):
    cfg = make_cfg(50)
    setup(cfg)
    with pytest.raises(ConfigValueError, match=pattern):
        build_backbone(cfg)


def test_r18_config_errors():
    cfg = make_cfg(18)
    cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 256
    with pytest.raises(ConfigValueError, match="MODEL.RESNETS.RES2_OUT_CHANNELS must be 64 for R18/R34"):
        build_backbone(cfg)


def test_fpn_builders_registered():
    for name in ("build_aa_resnet_backbone", "build_retinanet_aa_resnet_fpn_backbone"):
        assert BACKBONE_REGISTRY.get(name) is getattr(aa_resnet, name)  # a plain def, greppable
    torch.manual_seed(0)
    cfg = make_cfg(18, STAGES=("res5",))
    cfg.MODEL.BACKBONE.NAME = "build_retinanet_aa_resnet_fpn_backbone"
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res3", "res4", "res5"]
    cfg.MODEL.FPN.IN_FEATURES = ["res3", "res4", "res5"]
    cfg.MODEL.RETINANET.IN_FEATURES = ["p3", "p4", "p5", "p6", "p7"]
    fpn = build_backbone(cfg, ShapeSpec(channels=3))
    out = fpn(torch.randn(1, 3, 128, 96))
    assert {k: tuple(v.shape[-2:]) for k, v in out.items()} == {
        "p3": (16, 12), "p4": (8, 6), "p5": (4, 3), "p6": (2, 2), "p7": (1, 1)}
    assert len(augmented_layers(fpn.bottom_up)) == 2


@pytest.mark.parametrize(
    "config,paper_m",
    [("aa_retinanet_R_50_FPN_scratch_150ep.yaml", 33.1), ("aa_retinanet_R_101_FPN_scratch_150ep.yaml", 51.7)],
)
def test_retinanet_parameter_counts_match_table4(config, paper_m):
    """AA paper Table 4 (RetinaNet, 80 classes): AA-R50 33.1M, AA-R101 51.7M. Ours differ by the
    conv baseline's own offset (P6/P7 from P5 as in TF RetinaNet: our R50 RetinaNet has 33.85M vs
    the paper's 33.4M) and stay within 2%."""
    import os

    from detectron2.modeling import build_model

    from aadet.engine import load_config

    cfg = load_config(os.path.join(REPO, "configs", "COCO-Detection", config), ["MODEL.DEVICE", "cpu"])
    n = sum(p.numel() for p in build_model(cfg).parameters()) / 1e6
    assert abs(n - paper_m) / paper_m < 0.02, f"{config}: {n:.2f}M vs paper {paper_m}M"


def test_aa_impl_key_reaches_every_augmented_layer():
    from aadet.engine import get_aadet_cfg
    from aadet.layers import AugmentedConv2d
    from aadet.modeling.backbone.aa_resnet import build_aa_resnet_backbone
    from detectron2.layers import ShapeSpec

    cfg = get_aadet_cfg()
    cfg.MODEL.RESNETS.DEPTH = 18
    cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 64
    cfg.MODEL.RESNETS.NORM = "GN"
    cfg.MODEL.AA.IMPL = "materialized"
    net = build_aa_resnet_backbone(cfg, ShapeSpec(channels=3))
    impls = {m.impl for m in net.modules() if isinstance(m, AugmentedConv2d)}
    assert impls == {"materialized"}


def test_plain_arguments_build_what_the_config_builds():
    """Each builder takes plain arguments (what a LazyConfig gives it) and maps the config in one
    from_config: the same seed gives the same parameters either way."""
    import functools

    from detectron2.modeling.backbone.resnet import BasicStem

    from aadet.modeling.backbone.attention_fpn import convert_fpn_to_attention
    from aadet.modeling.backbone.fpn import build_retinanet_fpn

    cfg = make_cfg(18, STAGES=("res4", "res5"), MAX_INPUT_SIZE=128, NUM_HEADS=4)
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res3", "res4", "res5"]
    cfg.MODEL.FPN.IN_FEATURES, cfg.MODEL.FPN.OUT_CHANNELS = ["res3", "res4", "res5"], 32
    cfg.MODEL.FPN.SPATIAL_LAYER, cfg.MODEL.SASA.NUM_HEADS, cfg.MODEL.SASA.KERNEL_SIZE = "attention", 4, 3
    torch.manual_seed(0)
    from_cfg = aa_resnet.build_retinanet_aa_resnet_fpn_backbone(cfg, ShapeSpec(channels=3))
    torch.manual_seed(0)
    bottom_up = aa_resnet.build_aa_resnet_backbone(
        stem=BasicStem(3, 64, norm="BN"),
        aa_stages=("res4", "res5"),
        downsample_stages=("res3",),
        max_input_size=128,
        attention=dict(kappa=0.2, nu=0.1, num_heads=4),
        depth=18, norm="BN", res2_out_channels=64, width_per_group=64, num_groups=1,
        stride_in_1x1=False, res5_dilation=1, deform_on_per_stage=(False,) * 4,
        deform_modulated=False, deform_num_groups=1, zero_init_residual=False,
        out_features=["res3", "res4", "res5"], freeze_at=0,
    )
    plain = build_retinanet_fpn(
        bottom_up, in_features=["res3", "res4", "res5"], out_channels=32, norm="", fuse_type="sum",
        p6p7_source="p5", spatial_layers=functools.partial(convert_fpn_to_attention, kernel_size=3, num_heads=4),
    )
    a, b = from_cfg.state_dict(), plain.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
