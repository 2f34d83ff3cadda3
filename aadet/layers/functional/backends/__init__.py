"""The implementations behind the public functions, one route per file, on checked arguments.

The front ends (:mod:`..local_attention`, :mod:`..halo_attention`, :mod:`..logit_tables`, :mod:`..criss_cross`,
:mod:`..relative_attention`) check every argument once (:mod:`..checks`) and pick a route from
their registries; a route here assumes checked arguments and checks only what its own kernel
needs (dtypes, devices, tile sizes). Each is tested against :mod:`..reference`.

A file is named ``<family>_<route>.py``, the family the paper whose attention it computes, the
route what it does; which route is which is in the registries, each with a one-line summary:

* ``aa_*.py``: AA's global relative attention, the routes of
  :data:`~..logit_tables.LOGIT_TABLE_BACKENDS` (``fn(q, k, v, tables, key_index, *, query_chunk)
  -> out``); SASA's blocked routes call two of them (:mod:`.aa_sdpa`, :mod:`.aa_materialized`);
* ``sasa_*.py``: SASA's local attention, the routes of
  :data:`~..local_attention.LOCAL_ATTENTION_BACKENDS` (``fn(q, k, v, rel_h, rel_w, kernel_size)
  -> out``); :mod:`.sasa_blocked` computes it in query blocks with haloed windows (SASA's
  attention, not HaloNet's), :mod:`.sasa_channels_first` holds what the neighborhood and C++
  routes share;
* ``halonet_*.py``: HaloNet's blocked attention, the routes of
  :data:`~..halo_attention.HALO_ATTENTION_BACKENDS` (``fn(q, k, v, rel_h, rel_w, block_size,
  halo_size, query_stride) -> out``), the PyTorch ones on the block layout of
  :mod:`.halonet_blocks`;
* ``ccnet_*.py``: CCNet's criss-cross attention, the routes of
  :data:`~..criss_cross.CRISS_CROSS_BACKENDS` (``fn(q, k, v) -> out``);
* ``stem_cpp.py``: SASA's attention stem in its own fused kernel (no registry: the stem picks it
  by its ``impl``).

The C++ kernels (``csrc/<family>_cpu.cpp``) are built and cached by :mod:`.cpu_kernels`; what the
Triton kernels share (triton's presence and mode, the dtypes they take) is :mod:`.triton_kernels`;
the fused routes' one call into SDPA, shaped so that its fused kernels take it, is :mod:`.sdpa`.

The Triton and flex modules are imported on first use (:func:`~..dispatch.lazy_backend`), never by
``import aadet``; they also have public entry points with their own checks, for direct calls.
"""
