"""CCNet's ResNet (aadet/modeling/backbone/ccnet_resnet.py): one RCCA module before the last block
of MODEL.CCNET.STAGE, the ResNet's norm in its convs, frozen with its stage, and its keys checked
against the stage's width at build time, naming them."""
import os

import pytest
import torch
from detectron2.layers import FrozenBatchNorm2d, ShapeSpec
from detectron2.modeling import build_backbone, build_model
from torch import nn

import aadet  # noqa: F401
from aadet.config import ConfigValueError, check_ccnet_config
from aadet.engine import load_config
from aadet.layers import RecurrentCrissCrossAttention
from aadet.modeling.backbone import build_ccnet_resnet_backbone
from aadet.modeling.backbone.ccnet_resnet import CrissCrossBlock, insert_criss_cross
from detectron2.modeling.backbone import BasicStem
from detectron2.modeling.backbone.resnet import BasicBlock, ResNet

from tests.helpers import REPO

CCNET = os.path.join(REPO, "configs/COCO-Detection/ccnet_retinanet_R_50_FPN_scratch_150ep.yaml")
CONV = os.path.join(REPO, "configs/COCO-Detection/retinanet_R_50_FPN_scratch_150ep.yaml")


def _cfg(path=CCNET, *opts):
    return load_config(path, ["MODEL.DEVICE", "cpu", *opts])


def test_the_module_stands_before_the_last_block_of_res4():
    torch.manual_seed(0)
    ccnet = build_model(_cfg()).backbone.bottom_up
    conv = build_model(_cfg(CONV)).backbone.bottom_up
    names = [n for n, _ in ccnet.res4.named_children()]
    assert names == [str(i) for i in range(7)] and len(conv.res4) == 6  # R50's res4: 6 blocks + the module
    block = ccnet.res4[5]
    assert isinstance(block, CrissCrossBlock) and isinstance(block.rcca, RecurrentCrissCrossAttention)
    assert (block.in_channels, block.out_channels, block.stride) == (1024, 1024, 1)
    assert (block.rcca.inter_channels, block.rcca.recurrence, block.rcca.cca.num_heads) == (256, 2, 1)
    assert [type(m) for m in ccnet.res4[:5]] == [type(m) for m in conv.res4[:5]]
    assert type(ccnet.res4[6]) is type(conv.res4[5])
    x = torch.randn(1, 3, 96, 128)
    got, want = ccnet(x), conv(x)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}


def test_the_module_takes_the_resnet_norm_and_freezes_with_its_stage():
    cfg = _cfg(CCNET, "MODEL.RESNETS.NORM", "GN", "MODEL.CCNET.STAGE", "res3")
    block = build_backbone(cfg).bottom_up.res3[3]
    assert isinstance(block, CrissCrossBlock) and block.in_channels == 512
    assert isinstance(block.rcca.conva.norm, nn.GroupNorm) and isinstance(block.rcca.bottleneck.norm, nn.GroupNorm)

    frozen = build_backbone(_cfg(CCNET, "MODEL.RESNETS.NORM", "BN", "MODEL.BACKBONE.FREEZE_AT", 4)).bottom_up
    assert not any(p.requires_grad for p in frozen.res4[5].parameters())
    assert isinstance(frozen.res4[5].rcca.conva.norm, FrozenBatchNorm2d)
    assert all(p.requires_grad for p in frozen.res5.parameters())
    trained = build_backbone(_cfg(CCNET, "MODEL.RESNETS.NORM", "BN", "MODEL.BACKBONE.FREEZE_AT", 3)).bottom_up
    assert all(p.requires_grad for p in trained.res4[5].parameters())


@pytest.mark.parametrize("key,value", [
    ("MODEL.CCNET.REDUCTION", 512),  # q/k of 256 // 512 = 0 channels in res4
    ("MODEL.CCNET.NUM_HEADS", 3),  # divides neither 32 (q/k) nor 256 (v)
    ("MODEL.CCNET.INTER_CHANNELS", -1),  # at load
])
def test_keys_that_do_not_fit_the_stage_are_named_at_build_time(key, value):
    with pytest.raises(ConfigValueError, match=key.replace(".", r"\.")):
        build_backbone(_cfg(CCNET, key, value))


def test_the_default_width_is_checked_against_the_stage():
    with pytest.raises(ConfigValueError, match=r"MODEL\.CCNET\.INTER_CHANNELS must be an integer >= 1 \(0 means "
                       r"in_channels // 4, which is 0 for in_channels=2\); got 0"):
        tiny = ResNet(BasicStem(3, 2, norm=""), [ResNet.make_stage(BasicBlock, 2, in_channels=2, out_channels=2)])
        insert_criss_cross(tiny, "res2", norm="", inter_channels=None)


def test_plain_arguments_name_the_argument():
    stem = BasicStem(3, 64, norm="BN")
    resnet = dict(depth=50, norm="BN", res2_out_channels=256, width_per_group=64, num_groups=1,
                  stride_in_1x1=False, res5_dilation=1, deform_on_per_stage=[False] * 4, deform_modulated=False,
                  deform_num_groups=1, zero_init_residual=False, out_features=["res5"], freeze_at=0)
    with pytest.raises(ValueError, match="ccnet_stage must be one of"):
        build_ccnet_resnet_backbone(stem=stem, ccnet_stage="res6", **resnet)
    model = build_ccnet_resnet_backbone(stem=stem, ccnet_stage="res5", criss_cross=dict(recurrence=1), **resnet)
    assert isinstance(model.res5[2], CrissCrossBlock) and model.res5[2].rcca.recurrence == 1
    assert model.output_shape() == {"res5": ShapeSpec(channels=2048, stride=32)}


@pytest.mark.parametrize("norm", ["BN", ""])
def test_the_residual_block_starts_as_the_identity_and_learns_out_of_it(norm):
    torch.manual_seed(0)
    x = torch.randn(2, 64, 9, 7).relu()  # a stage's features: after a block's ReLU
    block = CrissCrossBlock(64, norm=norm)  # residual by default (MODEL.CCNET.RESIDUAL True)
    out = block(x)
    assert torch.equal(out, x)
    (out * torch.randn_like(out)).sum().backward()
    zeroed = block.rcca.bottleneck.norm if norm else block.rcca.bottleneck.conv
    assert zeroed.weight.grad.abs().max() > 1e-3  # the zeroed scale gets a gradient: the module can grow
    replacing = CrissCrossBlock(64, norm=norm, residual=False)
    assert (replacing(x) - x).abs().max() > 0.1


def test_bottleneck_kernel_key_reaches_the_module():
    assert build_backbone(_cfg()).bottom_up.res4[5].rcca.bottleneck.conv.kernel_size == (3, 3)
    block = build_backbone(_cfg(CCNET, "MODEL.CCNET.BOTTLENECK_KERNEL_SIZE", 1)).bottom_up.res4[5]
    assert block.rcca.bottleneck.conv.kernel_size == (1, 1)


def test_residual_key_reaches_the_block():
    assert build_backbone(_cfg()).bottom_up.res4[5].residual is True
    block = build_backbone(_cfg(CCNET, "MODEL.CCNET.RESIDUAL", False)).bottom_up.res4[5]
    assert block.residual is False and block.rcca.bottleneck.norm.weight.abs().min() > 0
    cfg = _cfg()
    cfg.defrost()
    cfg.MODEL.CCNET.RESIDUAL = 1  # set in code (yacs itself keeps a file's or a command line's type)
    with pytest.raises(ConfigValueError, match=r"MODEL\.CCNET\.RESIDUAL must be True or False; got 1"):
        check_ccnet_config(cfg)
