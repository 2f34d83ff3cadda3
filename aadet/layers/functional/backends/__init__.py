"""The implementations behind the public functions, one route per file, on checked arguments.

The front ends (:mod:`..local_attention`, :mod:`..halo_attention`, :mod:`..logit_tables`,
:mod:`..relative_attention`) check every argument once (:mod:`..checks`) and pick a route from
their registries; a route here assumes checked arguments and checks only what its own kernel
needs (dtypes, devices, tile sizes). Each is tested against :mod:`..reference`.

Which file is which route is in the registries, each route with a one-line summary: SASA's
:data:`~..local_attention.LOCAL_ATTENTION_BACKENDS` (``fn(q, k, v, rel_h, rel_w, kernel_size) ->
out``: ``sasa_*.py``), HaloNet's :data:`~..halo_attention.HALO_ATTENTION_BACKENDS` (``fn(q, k, v,
rel_h, rel_w, block_size, halo_size, query_stride) -> out``: ``halo_*.py``, the PyTorch ones on
the block layout of :mod:`.halo_blocks`) and the logit tables'
:data:`~..logit_tables.LOGIT_TABLE_BACKENDS` (``fn(q, k, v, tables, key_index, *, query_chunk) ->
out``: ``logit_tables_*.py``; AA's global attention and SASA's halo route).

The C++ kernels (``csrc/``) are built and cached by :mod:`.cpu_kernels`. SASA's attention stem has
its own fused kernel, :mod:`.stem_cpp` (no registry: the stem picks it by its ``impl``).

The Triton and flex modules are imported on first use (:func:`~..dispatch.lazy_backend`), never by
``import aadet``; they also have public entry points with their own checks, for direct calls.
"""
