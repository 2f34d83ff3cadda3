"""``model``: the papers' conv baseline, RetinaNet ResNet-50-FPN from scratch
(``configs/Base-RetinaNet-Scratch.yaml``), from plain arguments: ``AADetRetinaNet`` over
``build_retinanet_fpn`` over ``build_resnet`` (the stage builder the AA- and SASA-ResNets share).

Values written out are the recipe's (what Base-RetinaNet-Scratch.yaml sets); the others are the
YACS defaults (``_d``: Detectron2's and aadet/config.py's), their key in the comment. The attention
models change ``model.backbone.bottom_up`` (``aa_retinanet.py``, ``sasa_retinanet.py``).
"""
from detectron2.config import LazyCall as L
from detectron2.layers import ShapeSpec
from detectron2.modeling.anchor_generator import DefaultAnchorGenerator
from detectron2.modeling.backbone import BasicStem
from detectron2.modeling.box_regression import Box2BoxTransform
from detectron2.modeling.matcher import Matcher
from detectron2.modeling.meta_arch.retinanet import RetinaNetHead

from aadet.engine import get_aadet_cfg
from aadet.modeling.backbone import build_resnet, build_retinanet_fpn
from aadet.modeling.meta_arch.retinanet import AADetRetinaNet

_d = get_aadet_cfg()  # Detectron2's and aadet's defaults (aadet/config.py): the values' one home
_r, _f, _h = _d.MODEL.RESNETS, _d.MODEL.FPN, _d.MODEL.RETINANET

model = L(AADetRetinaNet)(
    backbone=L(build_retinanet_fpn)(
        bottom_up=L(build_resnet)(
            stem=L(BasicStem)(in_channels=3, out_channels=_r.STEM_OUT_CHANNELS, norm="${..norm}"),
            depth=50,
            norm="SyncBN",  # from-scratch norm for multi-GPU; GN for 1 process
            res2_out_channels=_r.RES2_OUT_CHANNELS,
            width_per_group=_r.WIDTH_PER_GROUP,
            num_groups=_r.NUM_GROUPS,
            stride_in_1x1=False,  # torchvision / TF layout: stride in the 3x3
            res5_dilation=_r.RES5_DILATION,
            deform_on_per_stage=list(_r.DEFORM_ON_PER_STAGE),
            deform_modulated=_r.DEFORM_MODULATED,
            deform_num_groups=_r.DEFORM_NUM_GROUPS,
            zero_init_residual=True,  # every block starts as its shortcut, as the papers' TPU ResNet
            out_features=["res3", "res4", "res5"],
            freeze_at=0,  # nothing frozen: there are no pretrained weights
        ),
        in_features=["res3", "res4", "res5"],
        out_channels=256,
        norm="SyncBN",
        fuse_type=_f.FUSE_TYPE,  # MODEL.FPN.FUSE_TYPE
        p6p7_source="p5",  # TF RetinaNet (the papers' codebase) builds P6/P7 from P5
        spatial_layer=_f.SPATIAL_LAYER,  # MODEL.FPN.SPATIAL_LAYER: "conv"
        spatial_layer_options={},
    ),
    head=L(RetinaNetHead)(
        input_shape=[ShapeSpec(channels=256)] * 5,  # one per level (p3-p7), FPN's out_channels
        num_classes="${..num_classes}",
        num_anchors=9,  # 3 sizes x 3 aspect ratios per position
        conv_dims=[256] * _h.NUM_CONVS,  # MODEL.RETINANET.NUM_CONVS convs of FPN's width
        norm="SyncBN",
        prior_prob=_h.PRIOR_PROB,  # MODEL.RETINANET.PRIOR_PROB
    ),
    anchor_generator=L(DefaultAnchorGenerator)(
        # 3 scales per octave, Detectron2's RetinaNet
        sizes=[[x, x * 2 ** (1.0 / 3), x * 2 ** (2.0 / 3)] for x in [32, 64, 128, 256, 512]],
        aspect_ratios=list(_d.MODEL.ANCHOR_GENERATOR.ASPECT_RATIOS),  # [[0.5, 1.0, 2.0]]
        strides=[8, 16, 32, 64, 128],  # of p3-p7
        offset=_d.MODEL.ANCHOR_GENERATOR.OFFSET,
    ),
    box2box_transform=L(Box2BoxTransform)(weights=list(_h.BBOX_REG_WEIGHTS)),
    anchor_matcher=L(Matcher)(thresholds=[0.4, 0.5], labels=[0, -1, 1], allow_low_quality_matches=True),
    num_classes=_h.NUM_CLASSES,  # MODEL.RETINANET.NUM_CLASSES: 80 (COCO)
    head_in_features=["p3", "p4", "p5", "p6", "p7"],
    focal_loss_alpha=_h.FOCAL_LOSS_ALPHA,
    focal_loss_gamma=_h.FOCAL_LOSS_GAMMA,
    smooth_l1_beta=0.0,
    box_reg_loss_type=_h.BBOX_REG_LOSS_TYPE,
    test_score_thresh=_h.SCORE_THRESH_TEST,
    test_topk_candidates=_h.TOPK_CANDIDATES_TEST,
    test_nms_thresh=_h.NMS_THRESH_TEST,
    max_detections_per_image=_d.TEST.DETECTIONS_PER_IMAGE,
    # torchvision-style normalization (BGR order): unit-variance inputs help training from scratch
    pixel_mean=[103.530, 116.280, 123.675],
    pixel_std=[57.375, 57.120, 58.395],
    input_format=_d.INPUT.FORMAT,
    vis_period=_d.VIS_PERIOD,
    # TEST.BBOX_VOTE (off): 0, or VOTE_TH to vote
    bbox_vote_thresh=_d.TEST.BBOX_VOTE.VOTE_TH if _d.TEST.BBOX_VOTE.ENABLED else 0.0,
)
