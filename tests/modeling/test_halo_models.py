"""HaloNet-ResNet: the backbone on the one stage builder, parameter counts against the conv and SASA
backbones, attention downsampling in the strided blocks, a float64 forward against the layers'
brute force, and config errors that name their key."""
import os
import re

import pytest
import torch
from detectron2.layers import ShapeSpec
from detectron2.modeling import build_model
from detectron2.modeling.backbone.resnet import BasicStem, BottleneckBlock, build_resnet_backbone
from torch import nn

import aadet  # noqa: F401  (backbone registrations)
from aadet.config import ConfigValueError
from aadet.layers import HaloSelfAttention2d
from aadet.modeling.backbone.halo_resnet import HaloBottleneckBlock, build_halo_resnet_backbone
from aadet.modeling.backbone.resnet_stages import basic_stem, resnet_from_config
from aadet.modeling.backbone.sasa_resnet import build_sasa_resnet_backbone

from tests.helpers import REPO
from tests.layers.test_halo_layer import brute_force
from tests.modeling.common import (
    R50_CONFIG,
    assert_same_output_shapes,
    counting_cfg,
    n_params,
    small_resnet26_cfg,
)

HALO_CONFIG = os.path.join(REPO, "configs", "COCO-Detection", "halo_retinanet_R_50_FPN_scratch_150ep.yaml")
SASA_CONFIG = os.path.join(REPO, "configs", "COCO-Detection", "sasa_convstem_retinanet_R_50_FPN_scratch_150ep.yaml")


def small_cfg(**halo):
    """A small HaloNet-ResNet-26 (fast on CPU): b 4, h 1, 2 heads."""
    halo = {"BLOCK_SIZE": 4, "HALO_SIZE": 1, "NUM_HEADS": 2, **halo}
    cfg = small_resnet26_cfg("build_retinanet_halo_resnet_fpn_backbone", stem_out_channels=32, HALO=halo)
    cfg.MODEL.RESNETS.OUT_FEATURES = ["res2", "res3", "res4", "res5"]
    return cfg


@pytest.mark.parametrize("depth,blocks", [(26, [1, 2, 4, 1]), (50, [3, 4, 6, 3])])
def test_depths_and_blocks(depth, blocks):
    cfg = small_cfg()
    cfg.MODEL.RESNETS.DEPTH = depth
    net = build_halo_resnet_backbone(cfg, ShapeSpec(channels=3))
    assert [len(s) for s in net.stages] == blocks
    assert all(isinstance(b, HaloBottleneckBlock) for s in net.stages for b in s)
    assert not [m for m in net.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert isinstance(net.stem, BasicStem)


def test_strided_blocks_downsample_by_attention_and_shapes_match_the_conv_resnet():
    cfg = small_cfg(STAGES=("res3", "res4", "res5"))
    cfg.MODEL.RESNETS.DEPTH = 50  # a depth Detectron2's own builder knows
    cfg.MODEL.RESNETS.STRIDE_IN_1X1 = True  # attention blocks take the stride anyway
    halo = build_halo_resnet_backbone(cfg, ShapeSpec(channels=3))
    conv = build_resnet_backbone(cfg, ShapeSpec(channels=3))
    assert all(type(b) is BottleneckBlock for b in halo.res2)  # res2 keeps its convs
    first = halo.res3[0]
    assert first.conv1.stride == (1, 1)
    attn = first.conv2
    assert isinstance(attn, HaloSelfAttention2d) and attn.stride == 2 and attn.query.stride == (2, 2)
    assert attn.key.stride == attn.value.stride == (1, 1)  # keys and values at full resolution
    assert (attn.block_size, attn.halo_size, attn.num_heads) == (4, 1, 2)
    assert isinstance(attn.norm, nn.BatchNorm2d)
    assert halo.res3[1].conv2.stride == 1
    assert assert_same_output_shapes(halo, conv)["res5"].shape == (1, 256, 3, 2)


def test_sasa_and_halo_blocks_are_one_block_class_with_another_attention_layer():
    """Both backbones' attention blocks are the shared block, whose subclasses only name their
    layer: the same modules around ``conv2`` (names and shapes: checkpoints of either line up
    outside the attention), the stride in ``conv2`` in both, and only ``conv2`` differs."""
    from aadet.layers import LocalSelfAttention2d
    from aadet.modeling.backbone.resnet_stages import AttentionBottleneckBlock
    from aadet.modeling.backbone.sasa_resnet import SASABottleneckBlock, build_sasa_resnet_backbone

    cfg = small_cfg(STAGES=("res3", "res4", "res5"))
    cfg.MODEL.RESNETS.STRIDE_IN_1X1 = True  # attention blocks take the stride anyway
    cfg.MODEL.SASA.STAGES, cfg.MODEL.SASA.NUM_HEADS, cfg.MODEL.SASA.KERNEL_SIZE = ("res3", "res4", "res5"), 2, 3
    nets = {"sasa": build_sasa_resnet_backbone(cfg, ShapeSpec(channels=3)),
            "halo": build_halo_resnet_backbone(cfg, ShapeSpec(channels=3))}
    layer = {"sasa": LocalSelfAttention2d, "halo": HaloSelfAttention2d}
    for name, cls in (("sasa", SASABottleneckBlock), ("halo", HaloBottleneckBlock)):
        assert issubclass(cls, AttentionBottleneckBlock)
        assert {k for k in vars(cls) if not k.startswith("__")} == {"attention_layer"}, cls
        assert cls.__init__ is AttentionBottleneckBlock.__init__ and cls.forward is BottleneckBlock.forward
        blocks = [b for s in nets[name].stages[1:] for b in s]
        assert blocks and all(type(b) is cls for b in blocks)
        assert all(isinstance(b.conv2, layer[name]) for b in blocks)
        first = nets[name].res3[0]
        assert first.conv1.stride == (1, 1) and first.conv2.stride == 2
    sasa, halo = ({k: v.shape for k, v in nets[n].state_dict().items() if ".conv2." not in k} for n in nets)
    assert list(sasa) == list(halo) and sasa == halo


def test_float64_forward_equals_the_layers_brute_force():
    """The whole backbone in float64, each attention layer once through its route and once
    through the pixel-by-pixel brute force: the same features."""
    cfg = small_cfg()
    torch.manual_seed(0)
    net = build_halo_resnet_backbone(cfg, ShapeSpec(channels=3)).double().eval()
    layers = [m for m in net.modules() if isinstance(m, HaloSelfAttention2d)]
    assert len(layers) == 8 and sum(m.stride == 2 for m in layers) == 3
    x = torch.randn(1, 3, 45, 38, dtype=torch.float64)
    with torch.no_grad():
        got = net(x)
        for m in layers:
            m.forward = lambda t, m=m: brute_force(m, t)
        ref = net(x)
    assert got["res5"].shape == (1, 256, 2, 2)
    for name in ref:
        assert float(ref[name].abs().max()) > 1e-3
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-10, msg=name)


def _r50(config):
    return build_model(counting_cfg(config))


def test_parameter_count_of_the_r50_config():
    """halo_retinanet_R_50_FPN_scratch_150ep.yaml: every 3x3 conv of res2-res5 (9 w^2) becomes
    q/k/v projections (3 w^2) and relative tables of 2(b + h) - 1 = 21 rows of dkh/2 each; against
    SASA's k = 7 (7 rows) at the same placement only the tables differ."""
    base, halo, sasa = (n_params(_r50(c)) for c in (R50_CONFIG, HALO_CONFIG, SASA_CONFIG))
    blocks = [(64, 3), (128, 4), (256, 6), (512, 3)]  # bottleneck width, blocks per stage
    assert base - halo == sum(n * (6 * w * w - 21 * (w // 8)) for w, n in blocks) == 7_534_920
    assert halo - sasa == sum(n * 14 * (w // 8) for w, n in blocks) == 6_608
    assert base == 33_845_556


@pytest.mark.parametrize(
    "setup,match",
    [
        (lambda c: setattr(c.MODEL.HALO, "BLOCK_SIZE", 5), "MODEL.HALO.BLOCK_SIZE must be a multiple of 2 when res3"),
    ],
)
def test_backbone_config_errors_name_the_key(setup, match):
    """HaloNet's own rule (those of every attention ResNet: test_resnet_stages.py)."""
    cfg = small_cfg()
    setup(cfg)
    with pytest.raises(ConfigValueError, match=match):
        build_halo_resnet_backbone(cfg, ShapeSpec(channels=3))


@pytest.mark.parametrize("build", [build_halo_resnet_backbone, build_sasa_resnet_backbone])
def test_plain_arguments_with_an_unknown_stage_name_raise(build):
    """Called with plain arguments (a LazyConfig's path, no config key to name), both attention
    builders check the stage names with the same function, naming the argument and the allowed
    names (the HaloNet builder used to build a plain ResNet for ``("res3", "res6")``)."""
    cfg = small_cfg()
    message = "attention_stages must be a subset of ('res2', 'res3', 'res4', 'res5'); got ('res3', 'res6')"
    with pytest.raises(ValueError, match=re.escape(message)):
        build(
            stem=basic_stem(cfg, ShapeSpec(channels=3)),
            attention_stages=("res3", "res6"),
            attention={},
            **resnet_from_config(cfg),
        )


def test_every_layer_option_has_its_key():
    from aadet.layers.halo_attention import HALO_ATTENTION_OPTIONS
    from aadet.modeling.attention_layers import halo_layer_kwargs

    assert set(halo_layer_kwargs(small_cfg())) == set(HALO_ATTENTION_OPTIONS) == {
        "block_size", "halo_size", "num_heads", "positional_encoding", "impl"}


def test_odd_block_size_is_fine_without_strided_attention_stages():
    cfg = small_cfg(STAGES=("res2",), BLOCK_SIZE=5)
    net = build_halo_resnet_backbone(cfg, ShapeSpec(channels=3))
    assert net.res2[0].conv2.block_size == 5
