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

SASA's and HaloNet's layer keys are their layers' attention options in upper case
(:func:`layer_kwargs_from_config`); AA's keys convert types and leave out the options the
AA-ResNet sets per stage, so :func:`aa_layer_kwargs` names them.

The keys were checked by :func:`aadet.config.validate_aadet_config` (with the layers' rules), and
the layers check their arguments when they are built: nothing is checked again here.
"""
from typing import Callable, Dict

from torch import nn

from ..layers.halo_attention import HaloSelfAttention2d
from ..layers.local_attention import LocalSelfAttention2d
from ..layers.local_attention_base import attention_options

__all__ = [
    "aa_layer_kwargs",
    "layer_kwargs_from_config",
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


def layer_kwargs_from_config(section, layer_class: type) -> Dict:
    """The attention options of ``layer_class``
    (:func:`~aadet.layers.local_attention_base.attention_options`) from the keys of ``section``
    (a config node, e.g. ``cfg.MODEL.SASA``) named as them in upper case."""
    return {name: section[name.upper()] for name in attention_options(layer_class)}


def sasa_layer_kwargs(cfg) -> dict:
    """:class:`LocalSelfAttention2d` options from ``MODEL.SASA.{KERNEL_SIZE, NUM_HEADS,
    POSITIONAL_ENCODING, BLOCK_SIZE, IMPL, RECOMPUTE_ATTENTION}``."""
    return layer_kwargs_from_config(cfg.MODEL.SASA, LocalSelfAttention2d)


def _attention_for_conv(layer_class: type, conv: nn.Conv2d, value_init, attention_kwargs: Dict):
    """A ``layer_class`` (a local attention layer) standing in for the 3x3 ``conv``: same in/out
    channels and stride; a bias iff ``conv`` has one; ``conv.norm`` and ``conv.activation``
    (Detectron2's ``Conv2d``; absent on a plain ``nn.Conv2d``) moved over.
    ``value_init(attn.value)`` initialises the value projection with the scheme of the
    convolution it replaces (queries, keys, relative tables keep the layer's defaults)."""
    stride = conv.stride[0] if isinstance(conv.stride, tuple) else conv.stride
    attn = layer_class(
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


def local_attention_for_conv(
    conv: nn.Conv2d, value_init: Callable[[nn.Conv2d], None], **attention_kwargs
) -> LocalSelfAttention2d:
    """A :class:`LocalSelfAttention2d` standing in for the 3x3 ``conv`` (stride 1 or 2, by
    pooling; see :func:`_attention_for_conv` for what it takes from ``conv``).

    Args:
        attention_kwargs: ``kernel_size``, ``num_heads``, ``positional_encoding``,
            ``block_size``, ``impl``, ``recompute_attention`` (e.g. :func:`sasa_layer_kwargs`).
    """
    return _attention_for_conv(LocalSelfAttention2d, conv, value_init, attention_kwargs)


def halo_layer_kwargs(cfg) -> dict:
    """:class:`HaloSelfAttention2d` options from ``MODEL.HALO.{BLOCK_SIZE, HALO_SIZE, NUM_HEADS,
    POSITIONAL_ENCODING, IMPL}``."""
    return layer_kwargs_from_config(cfg.MODEL.HALO, HaloSelfAttention2d)


def halo_attention_for_conv(
    conv: nn.Conv2d, value_init: Callable[[nn.Conv2d], None], **attention_kwargs
) -> HaloSelfAttention2d:
    """A :class:`HaloSelfAttention2d` standing in for the 3x3 ``conv``, its stride as attention
    downsampling (see :func:`_attention_for_conv` for what it takes from ``conv``).

    Args:
        attention_kwargs: ``block_size``, ``halo_size``, ``num_heads``, ``positional_encoding``,
            ``impl`` (e.g. :func:`halo_layer_kwargs`).
    """
    return _attention_for_conv(HaloSelfAttention2d, conv, value_init, attention_kwargs)
