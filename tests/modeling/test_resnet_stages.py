"""The shared ResNet stage builder is Detectron2's: with no attention stage, AA-ResNet and
SASA-ResNet (and the conv baseline's bottom-up) are ``build_resnet_backbone`` to the last weight
(same modules, same RNG order)."""
import pytest
import torch
from detectron2.config import get_cfg
from detectron2.layers import ShapeSpec
from detectron2.modeling.backbone.resnet import build_resnet_backbone

from aadet.config import ConfigValueError, add_aadet_config
from aadet.modeling.backbone.aa_resnet import build_aa_resnet_backbone
from aadet.modeling.backbone.fpn import build_retinanet_conv_resnet_fpn_backbone
from aadet.modeling.backbone.halo_resnet import build_halo_resnet_backbone
from aadet.modeling.backbone.resnet_stages import RESNET_BLOCKS_PER_STAGE, build_resnet
from aadet.modeling.backbone.sasa_resnet import build_sasa_resnet_backbone

from tests.modeling.test_halo_models import small_cfg as small_halo_cfg
from tests.modeling.test_sasa_models import small_cfg as small_sasa_cfg


def _cfg(depth, **resnets):
    cfg = get_cfg()
    add_aadet_config(cfg)
    cfg.MODEL.RESNETS.DEPTH = depth
    cfg.MODEL.RESNETS.NORM = "BN"
    cfg.MODEL.RESNETS.OUT_FEATURES = ["stem", "res2", "res3", "res4", "res5"]
    cfg.MODEL.BACKBONE.FREEZE_AT = 0
    cfg.MODEL.RESNETS.WIDTH_PER_GROUP = 8
    cfg.MODEL.RESNETS.STEM_OUT_CHANNELS = 16
    cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 64 if depth in (18, 34) else 32
    for key, value in resnets.items():
        setattr(cfg.MODEL.RESNETS, key, value)
    cfg.MODEL.AA.STAGES = ()
    cfg.MODEL.SASA.STAGES = ()
    return cfg


def _same_network(ours, reference):
    a, b = ours.state_dict(), reference.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [type(m) for m in ours.modules()] == [type(m) for m in reference.modules()]
    assert {k: (s.channels, s.stride) for k, s in ours.output_shape().items()} == {
        k: (s.channels, s.stride) for k, s in reference.output_shape().items()}
    assert [p.requires_grad for p in ours.parameters()] == [p.requires_grad for p in reference.parameters()]
    x = torch.randn(1, 3, 70, 54)
    with torch.no_grad():
        out, ref = ours.eval()(x), reference.eval()(x)
    assert all(torch.equal(out[k], ref[k]) for k in ref)


def _has_compiled_ops():
    try:
        import detectron2._C  # noqa: F401
    except ImportError:
        return False
    return True


NEEDS_C = pytest.mark.skipif(not _has_compiled_ops(), reason="deformable convs need detectron2._C")
CASES = [
    (18, {}),
    (34, {"NUM_GROUPS": 1}),
    (50, {}),
    (50, {"STRIDE_IN_1X1": True, "NUM_GROUPS": 4, "RES5_DILATION": 2}),
    pytest.param(50, {"DEFORM_ON_PER_STAGE": [False, False, True, True], "DEFORM_MODULATED": True},
                 marks=NEEDS_C),
    (101, {}),
]


@pytest.mark.parametrize("depth,resnets", CASES)
def test_aa_builder_without_attention_is_detectron2_resnet(depth, resnets):
    cfg = _cfg(depth, **resnets)
    cfg.MODEL.BACKBONE.FREEZE_AT = 2
    torch.manual_seed(0)
    reference = build_resnet_backbone(cfg, ShapeSpec(channels=3))
    torch.manual_seed(0)
    ours = build_aa_resnet_backbone(cfg, ShapeSpec(channels=3))
    _same_network(ours, reference)


@pytest.mark.parametrize("depth,resnets", CASES[2:])
def test_sasa_builder_without_attention_is_detectron2_resnet(depth, resnets):
    cfg = _cfg(depth, **resnets)
    torch.manual_seed(0)
    reference = build_resnet_backbone(cfg, ShapeSpec(channels=3))
    torch.manual_seed(0)
    ours = build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    _same_network(ours, reference)


@pytest.mark.parametrize("depth,resnets", CASES[:3] + CASES[4:])  # an FPN takes no dilated res5
def test_conv_retinanet_backbone_is_detectron2_resnet(depth, resnets):
    cfg = _cfg(depth, **resnets)
    cfg.MODEL.FPN.IN_FEATURES = ["res3", "res4", "res5"]
    torch.manual_seed(0)
    reference = build_resnet_backbone(cfg, ShapeSpec(channels=3))
    torch.manual_seed(0)
    ours = build_retinanet_conv_resnet_fpn_backbone(cfg, ShapeSpec(channels=3)).bottom_up
    _same_network(ours, reference)


@pytest.mark.parametrize("depth,blocks", [(26, (1, 2, 4, 1)), (38, (2, 3, 5, 2))])
def test_conv_backbone_builds_the_sasa_papers_baseline_depths(depth, blocks):
    """SASA's conv ResNet-26/38 baselines (paper Sec. 4.1), which Detectron2 does not build."""
    cfg = _cfg(depth)
    cfg.MODEL.FPN.IN_FEATURES = ["res3", "res4", "res5"]
    net = build_retinanet_conv_resnet_fpn_backbone(cfg, ShapeSpec(channels=3)).bottom_up
    assert tuple(len(s) for s in net.stages) == blocks == RESNET_BLOCKS_PER_STAGE[depth]
    assert all(type(b).__name__ == "BottleneckBlock" for s in net.stages for b in s)


def test_block_for_stage_sees_each_stage_once_with_its_geometry():
    cfg = _cfg(50, RES5_DILATION=2)
    seen = []

    def record(stage):
        seen.append((stage.name, stage.index, stage.stride, stage.in_channels, stage.out_channels,
                     stage.bottleneck_channels, stage.dilation))
        return None

    from detectron2.modeling.backbone.resnet import BasicStem

    build_resnet(cfg, stem=BasicStem(3, 16, norm="BN"), block_for_stage=record)
    assert seen == [
        ("res2", 0, 4, 16, 32, 8, 1),
        ("res3", 1, 8, 32, 64, 16, 1),
        ("res4", 2, 16, 64, 128, 32, 1),
        ("res5", 3, 16, 128, 256, 64, 2),
    ]
    assert RESNET_BLOCKS_PER_STAGE[50] == (3, 4, 6, 3)


@pytest.mark.parametrize(
    "depth,resnets,aa_stages,needle",
    [
        (50, {"DEFORM_ON_PER_STAGE": [False, True, False, False]}, ("res3",),
         "MODEL.RESNETS.DEFORM_ON_PER_STAGE must be all False in the attention stages"),
        (50, {"RES5_DILATION": 3}, (), "MODEL.RESNETS.RES5_DILATION must be 1 or 2"),
        (18, {"RES2_OUT_CHANNELS": 128}, (), "MODEL.RESNETS.RES2_OUT_CHANNELS must be 64 for R18/R34"),
        (34, {"RES5_DILATION": 2}, (), "MODEL.RESNETS.RES5_DILATION must be 1 for R18/R34"),
        (18, {"NUM_GROUPS": 2}, (), "MODEL.RESNETS.NUM_GROUPS must be 1 for R18/R34"),
        (27, {}, (), r"MODEL.RESNETS.DEPTH must be one of \[18, 26, 34, 38, 50, 101, 152\]"),
    ],
)
def test_resnet_config_errors(depth, resnets, aa_stages, needle):
    cfg = _cfg(depth, **resnets)
    cfg.MODEL.AA.STAGES = aa_stages
    with pytest.raises(ConfigValueError, match=needle):
        build_aa_resnet_backbone(cfg, ShapeSpec(channels=3))


@pytest.mark.parametrize("section,small_cfg,build", [
    ("HALO", small_halo_cfg, build_halo_resnet_backbone),
    ("SASA", small_sasa_cfg, build_sasa_resnet_backbone),
])
@pytest.mark.parametrize("key,value,needle", [
    ("RESNETS.NUM_GROUPS", 2, "MODEL.RESNETS.NUM_GROUPS must be 1 when res2 uses attention"),
    ("RESNETS.DEPTH", 34, "MODEL.RESNETS.DEPTH must be one of"),
    ("{}.NUM_HEADS", 3, "MODEL.{}.NUM_HEADS must be a divisor of the res2 bottleneck width 8"),
    ("{}.NUM_HEADS", 8, "MODEL.{}.NUM_HEADS must be at most 4"),  # 2 channels a head, relative
    ("RESNETS.RES5_DILATION", 2, "MODEL.RESNETS.RES5_DILATION must be 1 when res5 uses attention"),
    ("{}.STAGES", ("res6",), "MODEL.{}.STAGES must be a subset of"),
])
def test_attention_resnet_config_errors_name_the_key(section, small_cfg, build, key, value, needle):
    """The SASA and HaloNet ResNets share their builder body (build_attention_resnet): the same
    settings an attention stage cannot take, each error naming the key of its backbone."""
    cfg = small_cfg()
    node_name, _, name = f"MODEL.{key.format(section)}".rpartition(".")
    node = cfg
    for part in node_name.split("."):
        node = node[part]
    setattr(node, name, value)
    with pytest.raises(ConfigValueError, match=needle.format(section)):
        build(cfg, ShapeSpec(channels=3))


@pytest.mark.parametrize("builder,stages,depth", [
    (build_retinanet_conv_resnet_fpn_backbone, (), 18),
    (build_retinanet_conv_resnet_fpn_backbone, (), 26),
    (build_aa_resnet_backbone, ("res3", "res4", "res5"), 18),
    (build_aa_resnet_backbone, ("res3", "res4", "res5"), 26),
    (build_sasa_resnet_backbone, ("res2", "res3", "res4", "res5"), 26),  # bottlenecks only
])
def test_zero_init_residual_makes_every_block_start_as_its_shortcut(depth, builder, stages):
    """MODEL.RESNETS.ZERO_INIT_RESIDUAL: the last norm of every residual branch has scale 0, so
    each block's output is relu(shortcut(x)); nothing else changes (same RNG order)."""
    cfg = _cfg(depth)
    cfg.MODEL.FPN.IN_FEATURES = ["res3", "res4", "res5"]
    if builder is build_aa_resnet_backbone:
        cfg.MODEL.AA.STAGES = stages
    if builder is build_sasa_resnet_backbone:
        cfg.MODEL.SASA.STAGES, cfg.MODEL.SASA.NUM_HEADS = stages, 2
    torch.manual_seed(0)
    plain = builder(cfg, ShapeSpec(channels=3))
    cfg.MODEL.RESNETS.ZERO_INIT_RESIDUAL = True
    torch.manual_seed(0)
    zeroed = builder(cfg, ShapeSpec(channels=3))
    resnet = getattr(zeroed, "bottom_up", zeroed)
    blocks = [b for stage in resnet.stages for b in stage]
    assert len(blocks) == sum(RESNET_BLOCKS_PER_STAGE[depth])
    last = "conv2" if depth == 18 else "conv3"
    a, b = plain.state_dict(), zeroed.state_dict()
    zero_keys = {k for k in b if k.endswith(f"{last}.norm.weight") and f".{k}".count(".res") == 1}
    assert len(zero_keys) == len(blocks)
    for key in a:
        if key in zero_keys:
            assert torch.count_nonzero(b[key]) == 0 and torch.count_nonzero(a[key]) > 0, key
        else:
            assert torch.equal(a[key], b[key]), key
    x = torch.randn(2, blocks[0].in_channels, 12, 12)
    with torch.no_grad():
        blocks[0].eval()
        shortcut = blocks[0].shortcut(x) if blocks[0].shortcut is not None else x
        assert torch.equal(blocks[0](x), torch.relu(shortcut))


def test_zero_init_residual_needs_a_norm_with_a_scale():
    cfg = _cfg(50, NORM="", ZERO_INIT_RESIDUAL=True)
    with pytest.raises(ConfigValueError, match="MODEL.RESNETS.ZERO_INIT_RESIDUAL must be False unless"):
        build_aa_resnet_backbone(cfg, ShapeSpec(channels=3))
