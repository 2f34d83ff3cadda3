"""Plain ``nn.Module`` layers (usable without Detectron2) and their functional cores."""
from .attention_stem import STEM_IMPLS, SpatiallyAwareAttentionStem  # noqa: F401
from .augmented_conv import AugmentedConv2d  # noqa: F401
from .augmented_conv import POSITIONAL_ENCODINGS as AA_POSITIONAL_ENCODINGS  # noqa: F401
from .criss_cross import CrissCrossAttention2d, RecurrentCrissCrossAttention  # noqa: F401
from .halo_attention import HaloSelfAttention2d  # noqa: F401
from .halo_attention import POSITIONAL_ENCODINGS as HALO_POSITIONAL_ENCODINGS  # noqa: F401
from .local_attention import LocalSelfAttention2d  # noqa: F401
from .local_attention import POSITIONAL_ENCODINGS as SASA_POSITIONAL_ENCODINGS  # noqa: F401
from .functional.checks import check_kernel_size, check_num_heads  # noqa: F401
from .functional.criss_cross import CRISS_CROSS_BACKENDS  # noqa: F401
from .functional.halo_attention import HALO_ATTENTION_BACKENDS  # noqa: F401
from .functional.local_attention import LOCAL_ATTENTION_BACKENDS  # noqa: F401
from .functional.logit_tables import LOGIT_TABLE_BACKENDS  # noqa: F401
from .position_encoding import RELATIVE_EMBEDDING_NAMES, coord_channels, sine_2d  # noqa: F401
