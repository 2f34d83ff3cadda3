"""The attention layers of the models, from the config: the one place that reads the layer keys.

* :func:`aa_layer_kwargs`: ``MODEL.AA.*`` -> :class:`~aadet.layers.AugmentedConv2d` options
  (the AA-ResNet's ``attention`` argument).
* :func:`sasa_layer_kwargs`: ``MODEL.SASA.*`` -> :class:`~aadet.layers.LocalSelfAttention2d`
  options (SASA-ResNet blocks, attentional FPN, attentional RetinaNet head).
* :func:`local_attention_for_conv`: a :class:`~aadet.layers.LocalSelfAttention2d` standing in for
  a 3x3 convolution (same channels, stride, bias, norm and activation), used by all three.
* :func:`halo_layer_kwargs`: ``MODEL.HALO.*`` -> :class:`~aadet.layers.HaloSelfAttention2d`
  options (HaloNet-ResNet blocks); :func:`halo_attention_for_conv`: one standing in for a 3x3
  convolution.

The keys were checked by :func:`aadet.config.validate_aadet_config` (with the layers' rules), and
the layers check their arguments when they are built: nothing is checked again here.
"""
from typing import Callable

from torch import nn

from ..layers.halo_attention import HaloSelfAttention2d
from ..layers.local_attention import LocalSelfAttention2d

__all__ = [
    "aa_layer_kwargs",
    "sasa_layer_kwargs",
    "local_attention_for_conv",
    "halo_layer_kwargs",
    "halo_attention_for_conv",
]


def aa_layer_kwargs(cfg) -> dict:
    """:class:`AugmentedConv2d` options from ``MODEL.AA.{KAPPA, NU, NUM_HEADS,
    POSITIONAL_ENCODING, CLIP_DISTANCES, MIN_DK_PER_HEAD, IMPL}`` (those every augmented layer
    shares; the AA-ResNet adds each stage's ``max_size`` and ``attention_downsample``)."""
    aa = cfg.MODEL.AA
    return dict(
        kappa=float(aa.KAPPA),
        nu=float(aa.NU),
        num_heads=aa.NUM_HEADS,
        positional_encoding=aa.POSITIONAL_ENCODING,
        clip_distances=bool(aa.CLIP_DISTANCES),
        min_dk_per_head=aa.MIN_DK_PER_HEAD,
        impl=aa.IMPL,
    )


def sasa_layer_kwargs(cfg) -> dict:
    """:class:`LocalSelfAttention2d` options from ``MODEL.SASA.{KERNEL_SIZE, NUM_HEADS,
    POSITIONAL_ENCODING, BLOCK_SIZE, IMPL, RECOMPUTE_ATTENTION}``."""
    sa = cfg.MODEL.SASA
    return dict(
        kernel_size=sa.KERNEL_SIZE,
        num_heads=sa.NUM_HEADS,
        positional_encoding=sa.POSITIONAL_ENCODING,
        block_size=sa.BLOCK_SIZE,
        impl=sa.IMPL,
        recompute_attention=sa.RECOMPUTE_ATTENTION,
    )


def local_attention_for_conv(
    conv: nn.Conv2d, value_init: Callable[[nn.Conv2d], None], **attention_kwargs
) -> LocalSelfAttention2d:
    """A :class:`LocalSelfAttention2d` standing in for the 3x3 ``conv`` (stride 1 or 2).

    Same in/out channels and stride; a bias iff ``conv`` has one; ``conv.norm`` and
    ``conv.activation`` (Detectron2's ``Conv2d``; absent on a plain ``nn.Conv2d``) are moved
    over. ``value_init(attn.value)`` initialises the value projection with the scheme of the
    convolution it replaces (queries, keys, relative tables keep the layer's defaults).

    Args:
        attention_kwargs: ``kernel_size``, ``num_heads``, ``positional_encoding``,
            ``block_size``, ``impl``, ``recompute_attention`` (e.g. :func:`sasa_layer_kwargs`).
    """
    stride = conv.stride[0] if isinstance(conv.stride, tuple) else conv.stride
    attn = LocalSelfAttention2d(
        conv.in_channels,
        conv.out_channels,
        stride=stride,
        bias=conv.bias is not None,
        norm=getattr(conv, "norm", None),
        activation=getattr(conv, "activation", None),
        **attention_kwargs,
    )
    value_init(attn.value)
    return attn


def halo_layer_kwargs(cfg) -> dict:
    """:class:`HaloSelfAttention2d` options from ``MODEL.HALO.{BLOCK_SIZE, HALO_SIZE, NUM_HEADS,
    POSITIONAL_ENCODING, IMPL}``."""
    ha = cfg.MODEL.HALO
    return dict(
        block_size=ha.BLOCK_SIZE,
        halo_size=ha.HALO_SIZE,
        num_heads=ha.NUM_HEADS,
        positional_encoding=ha.POSITIONAL_ENCODING,
        impl=ha.IMPL,
    )


def halo_attention_for_conv(
    conv: nn.Conv2d, value_init: Callable[[nn.Conv2d], None], **attention_kwargs
) -> HaloSelfAttention2d:
    """A :class:`HaloSelfAttention2d` standing in for the 3x3 ``conv``: same channels; its
    stride becomes attention downsampling; bias, ``conv.norm`` and ``conv.activation`` moved over
    and the value projection initialised as in :func:`local_attention_for_conv`.

    Args:
        attention_kwargs: ``block_size``, ``halo_size``, ``num_heads``, ``positional_encoding``,
            ``impl`` (e.g. :func:`halo_layer_kwargs`).
    """
    stride = conv.stride[0] if isinstance(conv.stride, tuple) else conv.stride
    attn = HaloSelfAttention2d(
        conv.in_channels,
        conv.out_channels,
        stride=stride,
        bias=conv.bias is not None,
        norm=getattr(conv, "norm", None),
        activation=getattr(conv, "activation", None),
        **attention_kwargs,
    )
    value_init(attn.value)
    return attn
