"""Plain ``nn.Module`` layers (usable without Detectron2) and their functional cores."""
from .attention_stem import SpatiallyAwareAttentionStem  # noqa: F401
from .augmented_conv import AugmentedConv2d  # noqa: F401
from .local_attention import LocalSelfAttention2d  # noqa: F401
from .position_encoding import coord_channels, sine_2d  # noqa: F401
