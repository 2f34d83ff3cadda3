"""Pure tensor functions: the exact attention computations the layers are built on."""
from .logit_tables import MASK_VALUE, attention_with_logit_tables  # noqa: F401
from .relative_attention import (  # noqa: F401
    rel_to_abs,
    relative_attention_weights_2d,
    relative_logit_tables_2d,
    relative_logits_1d,
    relative_self_attention_2d,
    relative_table_for_length,
)
from .local_attention import (  # noqa: F401
    block_attention,
    block_padding_mask,
    block_self_attention_2d,
    blocks_to_map,
    map_to_blocks,
    local_attention_probs_2d,
    local_self_attention_2d,
)
