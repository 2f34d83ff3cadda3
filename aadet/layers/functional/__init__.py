"""Pure tensor functions: the exact attention computations the layers are built on.

Layout (NATTEN's): a public function per computation (the front ends below) checks its arguments
once -- every rule is in :mod:`.checks`, which the layers and the config use too -- and dispatches
on ``impl`` through its registry to implementations under :mod:`.backends`, one route per file,
on checked arguments. :mod:`.reference` holds the slow brute-force references every
implementation is tested (float64-exact) and benchmarked against; :mod:`.precision` the one rule
of the dtype they compute in.

* AA, global relative attention: :func:`relative_self_attention_2d`
  (:mod:`.relative_attention`) builds per-query row/column logit tables and hands them to a route
  of :func:`attention_with_logit_tables` (:mod:`.logit_tables`, registry
  :data:`~.logit_tables.LOGIT_TABLE_BACKENDS`).
* SASA, local attention: :func:`local_self_attention_2d` (:mod:`.local_attention`, registry
  :data:`~.local_attention.LOCAL_ATTENTION_BACKENDS`).
* HaloNet, blocked local attention: :func:`halo_attention_2d` (:mod:`.halo_attention`, registry
  :data:`~.halo_attention.HALO_ATTENTION_BACKENDS`); with ``block_size=1`` it is SASA's.
* CCNet, criss-cross attention (each pixel over its row and column):
  :func:`criss_cross_attention_2d` (:mod:`.criss_cross`, registry
  :data:`~.criss_cross.CRISS_CROSS_BACKENDS`).
* SASA stem, attention within non-overlapping blocks: :func:`block_attention` and the block
  layout (:mod:`.blocks`; small enough to be written out, a single route).
* Attention probabilities for analysis: :func:`local_attention_probs_2d` (SASA),
  :func:`halo_attention_probs_2d` (HaloNet),
  :func:`relative_attention_weights_2d` (AA, selected queries), :func:`block_attention_probs`
  (stem).

Each registry (a :class:`~.dispatch.RouteRegistry` of :class:`~.dispatch.Route`) is the one list
of its routes: the allowed ``impl`` values (``"auto"`` and the route names, checked by
:meth:`~.dispatch.RouteRegistry.check` in the layers and the config), the routes that export,
and the route lists in the front ends' docstrings and in error messages are all read from it.
``"auto"`` is resolved by ``auto_local_attention_impl`` / ``auto_halo_attention_impl`` /
``auto_logit_table_impl`` / ``auto_criss_cross_attention_impl``.

Adding an implementation is one file and one registry entry. For a local-attention kernel,
write ``functional/backends/sasa_<name>.py`` with ``fn(q, k, v, rel_h, rel_w, kernel_size) ->
out`` (``q, k [B, Nh, H, W, dk]`` with ``q`` already scaled, ``v [B, Nh, H, W, dv]``, ``rel_h
[k, dk//2]`` and ``rel_w [k, dk - dk//2]`` or both None, ``out [B, Nh, H, W, dv]``; arguments
arrive checked), then add to ``LOCAL_ATTENTION_BACKENDS`` in ``local_attention.py``::

    "name": Route(sasa_name_attention, "one line: what it is, where it runs"),  # blocked=True
                                                                                # for block_size=

For an AA / logit-table route, ``fn(q, k, v, tables, key_index, *, query_chunk) -> out`` (shapes
of :func:`attention_with_logit_tables`) in ``backends/aa_<name>.py`` and one entry in
``LOGIT_TABLE_BACKENDS``; for HaloNet, ``backends/halonet_<name>.py`` and one entry in
``HALO_ATTENTION_BACKENDS``; for CCNet, ``fn(q, k, v) -> out`` in ``backends/ccnet_<name>.py``
and one entry in ``CRISS_CROSS_BACKENDS``. The new name is then a valid ``impl`` everywhere
(layers, config, and the export check if ``exports=True``); make ``auto_*_impl`` pick it where it
should be the default; the tests compare every registered route with :mod:`.reference`. A backend
that needs an optional package (Triton) is registered through :func:`~.dispatch.lazy_backend`, so
that ``import aadet`` neither imports it nor needs the package.
"""
from .backends.sasa_blocked import MASK_VALUE  # noqa: F401
from .blocks import (  # noqa: F401
    add_block_relative_logits,
    block_attention,
    block_attention_probs,
    block_padding_mask,
    block_self_attention_2d,
    block_softmax,
    blocks_to_map,
    map_to_blocks,
)
from .criss_cross import CRISS_CROSS_BACKENDS, criss_cross_attention_2d  # noqa: F401
from .dispatch import AUTO, Route, RouteRegistry, is_exporting  # noqa: F401
from .halo_attention import (  # noqa: F401
    HALO_ATTENTION_BACKENDS,
    halo_attention_2d,
    halo_attention_probs_2d,
)
from .local_attention import (  # noqa: F401
    LOCAL_ATTENTION_BACKENDS,
    local_attention_probs_2d,
    local_self_attention_2d,
)
from .logit_tables import LOGIT_TABLE_BACKENDS, attention_with_logit_tables  # noqa: F401
from .relative_attention import (  # noqa: F401
    relative_attention_weights_2d,
    relative_logit_tables_2d,
    relative_windows,
    relative_self_attention_2d,
    relative_table_for_length,
)
