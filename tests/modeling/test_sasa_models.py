"""SASA models: the SASA-ResNet backbone, the attentional FPN and RetinaNet head, parameter
fidelity to the paper's Table 2, and a training step of small fully attentional RetinaNets."""

import pytest
import torch
from detectron2.layers import FrozenBatchNorm2d, ShapeSpec
from detectron2.modeling import build_backbone, build_model
from detectron2.modeling.backbone.fpn import FPN, LastLevelP6P7
from detectron2.modeling.backbone.resnet import BasicStem, BottleneckBlock, build_resnet_backbone
from detectron2.structures import Boxes, Instances
from detectron2.utils.events import EventStorage
from torch import nn

import aadet  # noqa: F401  (meta-architecture, conv baseline builders)
from aadet.config import ConfigValueError, layer_defaults
from aadet.layers.attention_stem import SpatiallyAwareAttentionStem
from aadet.layers.local_attention import LocalSelfAttention2d
from aadet.modeling.backbone.attention_fpn import convert_fpn_to_attention
from aadet.modeling.attention_head import AttentionRetinaNetHead
from aadet.modeling.backbone.fpn import build_retinanet_fpn
from aadet.modeling.backbone.sasa_resnet import SASABottleneckBlock, build_sasa_resnet_backbone

from tests.modeling.common import assert_same_output_shapes, counting_cfg, n_params, small_resnet26_cfg

C = 64  # FPN / head width of the small models


def attn_params(c_in, c_out, k=7, heads=8, bias=False, relative=True):
    dkh = c_out // heads
    return 3 * c_in * c_out + (2 * k * (dkh // 2) if dkh % 2 == 0 else k * dkh) * relative + c_out * bias


def small_cfg(**sasa):
    """A small SASA-ResNet-26 RetinaNet (fast on CPU), norms that work with batch size 1."""
    sasa = {"NUM_HEADS": 4, "KERNEL_SIZE": 5, "STEM_NUM_HEADS": 2, **sasa}
    cfg = small_resnet26_cfg("build_retinanet_sasa_resnet_fpn_backbone", stem_out_channels=16, SASA=sasa)
    cfg.MODEL.FPN.OUT_CHANNELS = C  # GN(32, C) needs 2 values per group on a 1x1 P7
    cfg.MODEL.FPN.NORM = ""
    cfg.MODEL.RETINANET.NORM = "GN"
    cfg.MODEL.RETINANET.NUM_CLASSES = 3
    return cfg


# ----------------------------------------------------------------------------- backbone
@pytest.mark.parametrize("depth,blocks", [(26, [1, 2, 4, 1]), (38, [2, 3, 5, 2]),
                                          (50, [3, 4, 6, 3]), (101, [3, 4, 23, 3])])
def test_depths(depth, blocks):
    cfg = small_cfg()
    cfg.MODEL.RESNETS.DEPTH = depth
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res2", "res3", "res4", "res5"]
    net = build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    assert [len(s) for s in net.stages] == blocks
    assert all(isinstance(b, SASABottleneckBlock) for s in net.stages for b in s)
    assert sum(1 for m in net.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)) == 0


def test_backbone_matches_conv_resnet_shapes_on_odd_inputs():
    cfg = small_cfg(STAGES=("res3", "res4", "res5"), STEM="attention")
    cfg.MODEL.RESNETS.DEPTH = 50
    cfg.MODEL.RESNETS.OUT_FEATURES = ["stem", "res2", "res3", "res4", "res5"]
    sasa = build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    conv = build_resnet_backbone(cfg, ShapeSpec(channels=3))
    assert isinstance(sasa.stem, SpatiallyAwareAttentionStem)
    # res2 keeps its 3x3 convs (Table 3 mixture), the other stages have attention
    assert all(type(b) is BottleneckBlock for b in sasa.res2)
    assert all(isinstance(b, SASABottleneckBlock) for s in (sasa.res3, sasa.res4, sasa.res5) for b in s)
    assert assert_same_output_shapes(sasa, conv)["res5"].shape == (1, 256, 3, 2)


def test_stem_impl_comes_from_the_config():
    """MODEL.SASA.STEM_IMPL reaches the attention stem ("auto" by default)."""
    assert small_cfg().MODEL.SASA.STEM_IMPL == "auto"
    net = build_sasa_resnet_backbone(small_cfg(STEM="attention", STEM_IMPL="cpp"), ShapeSpec(channels=3))
    assert net.stem.impl == "cpp"
    net = build_sasa_resnet_backbone(small_cfg(STEM="attention", STEM_IMPL="projected"), ShapeSpec(channels=3))
    assert net.stem.route() == "projected"


def test_attention_block_structure_and_stride():
    cfg = small_cfg()
    cfg.MODEL.RESNETS.STRIDE_IN_1X1 = True  # attention blocks take the stride anyway
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res3"]
    net = build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    first = net.res3[0]
    assert first.conv1.stride == (1, 1)
    assert isinstance(first.conv2, LocalSelfAttention2d) and first.conv2.stride == 2
    assert isinstance(first.conv2.norm, nn.BatchNorm2d)
    assert (first.conv2.kernel_size, first.conv2.num_heads) == (5, 4)
    assert first.conv2.in_channels == first.conv2.out_channels == 16
    assert isinstance(net.stem, BasicStem)


def test_freeze_at():
    cfg = small_cfg(STEM="attention")
    cfg.MODEL.BACKBONE.FREEZE_AT = 2
    net = build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    assert not any(p.requires_grad for p in net.stem.parameters())
    assert not any(p.requires_grad for p in net.res2.parameters())
    assert all(p.requires_grad for p in net.res3.parameters())
    assert isinstance(net.stem.norm, FrozenBatchNorm2d)
    assert isinstance(net.res2[0].conv2.norm, FrozenBatchNorm2d)


@pytest.mark.parametrize(
    "setup,match",
    [
        (lambda c: setattr(c.MODEL.SASA, "STEM", "mlp"), "MODEL.SASA.STEM"),
    ],
)
def test_backbone_config_errors(setup, match):
    """SASA's own key (those of every attention ResNet: test_resnet_stages.py)."""
    cfg = small_cfg()
    setup(cfg)
    with pytest.raises(ConfigValueError, match=match):
        build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))


def test_grouped_convs_allowed_in_conv_stages():
    cfg = small_cfg(STAGES=("res5",))
    cfg.MODEL.RESNETS.NUM_GROUPS = 2
    cfg.MODEL.RESNETS.WIDTH_PER_GROUP = 4
    with pytest.raises(ConfigValueError, match="MODEL.RESNETS.NUM_GROUPS"):
        build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    cfg.MODEL.SASA.STAGES = ()
    net = build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    assert net.res5[0].conv2.groups == 2


# ----------------------------------------------------------------------------- FPN
def _small_fpn():
    cfg = small_cfg()
    bottom_up = build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3))
    return build_retinanet_fpn(cfg, bottom_up)


def _conv3(module):
    return [m for m in module.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]


@pytest.mark.parametrize("top_block", [False, True])
def test_fpn_conversion_replaces_and_keeps_aliases(top_block):
    torch.manual_seed(0)
    fpn = _small_fpn()
    assert isinstance(fpn.top_block, LastLevelP6P7) and fpn.top_block.in_feature == "p5"
    x = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        shapes = {k: v.shape for k, v in fpn.eval()(x).items()}
    before = n_params(fpn)
    laterals = [getattr(fpn, f"fpn_lateral{s}") for s in (3, 4, 5)]
    convert_fpn_to_attention(fpn, kernel_size=5, num_heads=4, block_size=8, top_block=top_block)
    names = [f"fpn_output{s}" for s in (5, 4, 3)]  # output_convs is in top-down order
    for i, name in enumerate(names):
        new = getattr(fpn, name)
        assert isinstance(new, LocalSelfAttention2d) and new.bias is not None  # FPN.NORM "": bias
        assert fpn.output_convs[i] is new
        assert not _conv3(new)
    assert [getattr(fpn, f"fpn_lateral{s}") for s in (3, 4, 5)] == laterals  # laterals untouched
    assert all(a is b for a, b in zip(fpn.lateral_convs, laterals[::-1]))
    per_layer = (9 * C * C + C) - attn_params(C, C, k=5, heads=4, bias=True)
    assert per_layer == 6 * C * C - 2 * 5 * (C // 8)
    replaced = 3 + 2 * top_block
    assert before - n_params(fpn) == replaced * per_layer
    p6, p7 = fpn.top_block.p6, fpn.top_block.p7
    if top_block:
        assert isinstance(p6, LocalSelfAttention2d) and p6.stride == 2 and p7.stride == 2
        assert not _conv3(fpn.top_block)
    else:
        assert isinstance(p6, nn.Conv2d) and isinstance(p7, nn.Conv2d)
    assert [type(m) for m in _conv3(fpn)] == ([] if top_block else [nn.Conv2d, nn.Conv2d])
    with torch.no_grad():
        out = fpn(x)
    assert {k: v.shape for k, v in out.items()} == shapes


def test_fpn_conversion_keeps_norm():
    cfg = small_cfg()
    cfg.MODEL.FPN.NORM = "GN"
    fpn = build_retinanet_fpn(cfg, build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3)))
    old_norm = fpn.fpn_output3.norm
    convert_fpn_to_attention(fpn, kernel_size=5, num_heads=4)
    assert fpn.fpn_output3.norm is old_norm and isinstance(old_norm, nn.GroupNorm)
    assert fpn.fpn_output3.bias is None  # Detectron2: no conv bias under a norm


def test_fpn_registry_converter():
    cfg = small_cfg()
    cfg.MODEL.FPN.SPATIAL_LAYER = "attention"
    fpn = build_backbone(cfg)
    assert isinstance(fpn, FPN)
    assert all(isinstance(m, LocalSelfAttention2d) for m in fpn.output_convs)
    assert fpn.fpn_output4.kernel_size == 5 and fpn.fpn_output4.num_heads == 4
    assert isinstance(fpn.top_block.p6, nn.Conv2d)  # P6/P7 stay conv (Table 2 fidelity)


@pytest.mark.parametrize("top_block", [False, True])
def test_attention_top_block_key(top_block):
    """MODEL.FPN.ATTENTION_TOP_BLOCK makes P6/P7's stride-2 convs local attention as well: no 3x3
    conv is left in the FPN, and the levels, strides and shapes are the conv FPN's."""
    cfg = small_cfg()
    cfg.MODEL.FPN.SPATIAL_LAYER = "attention"
    cfg.MODEL.FPN.ATTENTION_TOP_BLOCK = top_block
    torch.manual_seed(0)
    fpn = build_backbone(cfg).eval()
    p6, p7 = fpn.top_block.p6, fpn.top_block.p7
    kind = LocalSelfAttention2d if top_block else nn.Conv2d
    assert isinstance(p6, kind) and isinstance(p7, kind)
    assert [type(m) for m in _conv3(fpn)] == ([] if top_block else [nn.Conv2d, nn.Conv2d])
    if top_block:
        assert (p6.stride, p7.stride, p6.kernel_size, p6.num_heads) == (2, 2, 5, 4)
    strides = {"p3": 8, "p4": 16, "p5": 32, "p6": 64, "p7": 128}
    shapes = fpn.output_shape()
    assert {k: (v.channels, v.stride) for k, v in shapes.items()} == {k: (C, s) for k, s in strides.items()}
    with torch.no_grad():
        out = fpn(torch.randn(2, 3, 128, 96))
    assert list(out) == list(strides)
    for name, s in strides.items():
        assert tuple(out[name].shape) == (2, C, -(-128 // s), -(-96 // s)), name
        assert torch.isfinite(out[name]).all()


# ----------------------------------------------------------------------------- head
def test_attention_head_replaces_towers_only():
    torch.manual_seed(0)
    cfg = small_cfg(HEAD_KERNEL_SIZE=3)  # the head's window is its own key; the trunk's k is 5
    cfg.MODEL.RETINANET.HEAD_NAME = "AttentionRetinaNetHead"
    shapes = [ShapeSpec(channels=C, stride=s) for s in (8, 16, 32, 64, 128)]
    from aadet.modeling.meta_arch.retinanet import build_retinanet_head
    from detectron2.modeling.meta_arch.retinanet import RetinaNetHead

    head = build_retinanet_head(cfg, shapes)
    conv_head = RetinaNetHead(cfg, shapes)
    assert isinstance(head, AttentionRetinaNetHead)
    towers = list(head.cls_subnet) + list(head.bbox_subnet)
    attn = [m for m in towers if isinstance(m, LocalSelfAttention2d)]
    assert len(attn) == 8 and not [m for m in towers if isinstance(m, nn.Conv2d)]
    assert {m.kernel_size for m in attn} == {3} and {m.num_heads for m in attn} == {4}
    assert sum(isinstance(m, nn.GroupNorm) for m in towers) == 8
    assert sum(isinstance(m, nn.ReLU) for m in towers) == 8
    assert isinstance(head.cls_score, nn.Conv2d) and head.cls_score.kernel_size == (3, 3)
    assert isinstance(head.bbox_pred, nn.Conv2d) and head.bbox_pred.kernel_size == (3, 3)
    assert torch.allclose(head.cls_score.bias, torch.full_like(head.cls_score.bias, -4.59511985))
    assert abs(float(attn[0].value.weight.detach().std()) - 0.01) < 0.002
    assert float(attn[0].bias.detach().abs().max()) == 0
    per_layer = (9 * C * C + C) - attn_params(C, C, k=3, heads=4, bias=True)
    assert n_params(conv_head) - n_params(head) == 8 * per_layer
    feats = [torch.randn(1, C, 16 // 2 ** i + 1, 12 // 2 ** i + 1) for i in range(5)]
    with torch.no_grad():
        logits, deltas = head(feats)
        ref_logits, ref_deltas = conv_head(feats)
    assert [t.shape for t in logits] == [t.shape for t in ref_logits]
    assert [t.shape for t in deltas] == [t.shape for t in ref_deltas]


def test_attention_head_plain_arguments():
    shapes = [ShapeSpec(channels=16, stride=s) for s in (8, 16)]
    head = AttentionRetinaNetHead(input_shape=shapes, num_classes=2, num_anchors=3,
                                  conv_dims=[16, 16], kernel_size=3, num_heads=2, block_size=4)
    attn = [m for m in head.cls_subnet if isinstance(m, LocalSelfAttention2d)]
    assert len(attn) == 2 and attn[0].kernel_size == 3 and attn[0].num_heads == 2
    logits, deltas = head([torch.randn(2, 16, 9, 7), torch.randn(2, 16, 5, 4)])
    assert logits[0].shape == (2, 6, 9, 7) and deltas[1].shape == (2, 12, 5, 4)


# ----------------------------------------------------------------------------- fidelity
def _r50_retinanet(backbone, fpn="conv", head="RetinaNetHead", stem="conv"):
    cfg = counting_cfg()  # our conv baseline: R50-FPN, P3-P7 (P6/P7 from P5), 9 anchors
    cfg.MODEL.RETINANET.NUM_CLASSES = 80
    cfg.MODEL.BACKBONE.NAME = backbone
    cfg.MODEL.FPN.SPATIAL_LAYER = fpn
    cfg.MODEL.RETINANET.HEAD_NAME = head
    cfg.MODEL.SASA.STEM = stem
    return build_model(cfg)


def test_parameter_fidelity_to_paper_table2():
    """SASA Table 2: baseline 33.4M, attention backbone 25.9M (both stems), + attentional FPN and
    heads 22.0M. Our deltas against our own conv baseline must be within 0.5M of the paper's."""
    base = n_params(_r50_retinanet("build_retinanet_conv_resnet_fpn_backbone"))
    sasa = "build_retinanet_sasa_resnet_fpn_backbone"
    backbone = n_params(_r50_retinanet(sasa))
    backbone_stem = n_params(_r50_retinanet(sasa, stem="attention"))
    full = n_params(_r50_retinanet(sasa, "attention", "AttentionRetinaNetHead"))
    full_stem = n_params(_r50_retinanet(sasa, "attention", "AttentionRetinaNetHead", "attention"))
    # exact values (documented in the report / docstrings)
    assert base == 33_845_556
    assert base - backbone == 7_541_528  # paper: 33.4 - 25.9 = 7.5M
    assert backbone - full == 11 * (9 * 256 * 256 - 3 * 256 * 256 - 2 * 7 * 16) == 4_322_912  # paper 3.9M
    assert backbone - backbone_stem == full - full_stem == 7_040  # attention stem: 2.4k vs conv 9.5k
    assert abs((base - backbone) / 1e6 - 7.5) < 0.5
    assert abs((backbone - full) / 1e6 - 3.9) < 0.5
    assert abs(base / 1e6 - 33.4) < 0.5 and abs(full / 1e6 - 22.0) < 0.5


# ----------------------------------------------------------------------------- training step
def _batch():
    inst = Instances((128, 96))
    inst.gt_boxes = Boxes(torch.tensor([[10.0, 20.0, 60.0, 90.0], [40.0, 5.0, 90.0, 50.0]]))
    inst.gt_classes = torch.tensor([0, 2])
    return [{"image": torch.randint(0, 255, (3, 128, 96)).float(), "instances": inst}]


@pytest.mark.parametrize("stem", ["conv", "attention"])
def test_training_step_fully_attentional_retinanet(stem):
    torch.manual_seed(0)
    cfg = small_cfg(STEM=stem)
    cfg.MODEL.FPN.SPATIAL_LAYER = "attention"
    cfg.MODEL.RETINANET.HEAD_NAME = "AttentionRetinaNetHead"
    # every probed layer gets a gradient at init: with the COCO recipe's zero init a block's branch
    # starts at 0 and its layers get none before the first step
    cfg.MODEL.RESNETS.ZERO_INIT_RESIDUAL = False
    model = build_model(cfg)
    model.train()
    with EventStorage(0):
        losses = model(_batch())
    assert set(losses) == {"loss_cls", "loss_box_reg"}
    total = sum(losses.values())
    assert torch.isfinite(total) and float(total) > 0
    total.backward()
    probes = {
        "stem": model.backbone.bottom_up.stem,
        "res2": model.backbone.bottom_up.res2[0].conv2,
        "res5": model.backbone.bottom_up.res5[0].conv2,
        "fpn": model.backbone.fpn_output3,
        "head": model.head.cls_subnet[0],
    }
    for name, module in probes.items():
        for pname, p in module.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), (name, pname)
        assert float(sum(p.grad.abs().sum() for p in module.parameters())) > 0, name
    if stem == "attention":
        assert isinstance(probes["stem"], SpatiallyAwareAttentionStem)
        assert float(probes["stem"].nu.grad.abs().sum()) > 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = model.backbone.bottom_up.res4[0].conv2.rel_h.detach().clone()
    opt.step()
    assert not torch.equal(before, model.backbone.bottom_up.res4[0].conv2.rel_h.detach())
    model.eval()
    with torch.no_grad():
        out = model([{"image": _batch()[0]["image"]}])
    assert out[0]["instances"].image_size == (128, 96)


# ----------------------------------------------------------------------------- layer options
def test_recompute_attention_key_reaches_every_attention_layer():
    """MODEL.SASA.RECOMPUTE_ATTENTION reaches every local-attention layer the builders make
    (backbone, FPN with its P6/P7, head) and changes no parameter or buffer name."""
    def build(recompute):
        cfg = small_cfg(RECOMPUTE_ATTENTION=recompute)
        cfg.MODEL.FPN.SPATIAL_LAYER = "attention"
        cfg.MODEL.FPN.ATTENTION_TOP_BLOCK = True
        cfg.MODEL.RETINANET.HEAD_NAME = "AttentionRetinaNetHead"
        return build_model(cfg)

    model = build(True)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LocalSelfAttention2d)}
    assert {name.split(".")[0] + "." + name.split(".")[1] for name in layers} >= {
        "backbone.bottom_up", "backbone.fpn_output3", "backbone.top_block", "head.cls_subnet"}
    assert all(m.recompute_attention is True for m in layers.values())
    assert list(model.state_dict()) == list(build(False).state_dict())


def test_layer_options_pass_through_unchanged():
    """Options not given fall back to the layer's defaults at every level; given ones arrive."""
    block = SASABottleneckBlock(16, 32, bottleneck_channels=16, stride=2, num_heads=2, impl="fused")
    assert (block.conv2.num_heads, block.conv2.impl, block.conv2.stride) == (2, "fused", 2)
    assert block.conv2.kernel_size == layer_defaults(LocalSelfAttention2d)["kernel_size"]
    with pytest.raises(TypeError, match="kernel"):
        SASABottleneckBlock(16, 32, bottleneck_channels=16, kernel=3)
    shapes = [ShapeSpec(channels=16, stride=8)]
    head = AttentionRetinaNetHead(input_shape=shapes, num_classes=2, num_anchors=3, conv_dims=[16],
                                  num_heads=4, block_size=4)
    attn = head.cls_subnet[0]
    assert (attn.num_heads, attn.block_size) == (4, 4)
    assert attn.kernel_size == layer_defaults(LocalSelfAttention2d)["kernel_size"]
