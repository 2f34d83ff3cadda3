"""The implementations behind the public functions, one route per file, on checked arguments.

The front ends (:mod:`..local_attention`, :mod:`..logit_tables`, :mod:`..relative_attention`)
check every argument once (:mod:`..checks`) and pick a route from their registries; a route here
assumes checked arguments and checks only what its own kernel needs (dtypes, devices, tile
sizes). Each is tested against :mod:`..reference`.

SASA local attention, ``fn(q, k, v, rel_h, rel_w, kernel_size) -> out``
(:data:`~..local_attention.LOCAL_ATTENTION_BACKENDS`):

* :mod:`.sasa_neighborhood`: ``"neighborhood"``, offset by offset with its own backward (CPU);
* :mod:`.sasa_cpp`: ``"cpp"``, a C++ kernel, one pass over the window per query row (CPU);
* :mod:`.sasa_halo`: ``"fused"`` / ``"materialized"``, halo blocks whose position terms and masks
  are logit tables, handed to the SDPA or materialized logit-table route (``block_size=``);
* :mod:`.sasa_triton`: ``"triton"``, fused Triton kernels with ``q . r`` in-kernel (CUDA).

HaloNet blocked attention, ``fn(q, k, v, rel_h, rel_w, block_size, halo_size, query_stride) -> out``
(:data:`~..halo_attention.HALO_ATTENTION_BACKENDS`), the PyTorch ones on the block layout of
:mod:`.halo_blocks`:

* :mod:`.halo_cpp`: ``"cpp"``, a C++ kernel, block by block in cache, logits recomputed in backward (CPU);
* :mod:`.halo_bmm`: ``"bmm"``, batched matmuls with a hand-written backward;
* :mod:`.halo_materialized`: ``"materialized"``, logits and softmax written out in plain ops (export);
* :mod:`.halo_sdpa`: ``"fused"``, SDPA with the position tables and border mask as its bias (CUDA).

Attention with logit tables, ``fn(q, k, v, tables, key_index, *, query_chunk) -> out``
(:data:`~..logit_tables.LOGIT_TABLE_BACKENDS`; AA's global attention and the halo route):

* :mod:`.logit_tables_sdpa`: ``"fused"``, the augmented dot product through SDPA;
* :mod:`.logit_tables_materialized`: ``"materialized"``, explicit float32 logits, chunked;
* :mod:`.logit_tables_triton`: ``"triton"``, flash attention with AA's row/column tables in-kernel;
* :mod:`.logit_tables_flex`: ``"flex"``, ``flex_attention`` with the tables in its ``score_mod``;
* :mod:`.logit_tables_cpp`: ``"cpp"``, a C++ kernel with AA's row/column tables inside the softmax (CPU).

The C++ kernels (``csrc/``) are built and cached by :mod:`.cpu_kernels`.

The Triton and flex modules are imported on first use (:func:`~..dispatch.lazy_backend`), never by
``import aadet``; they also have public entry points with their own checks, for direct calls.
"""
