"""Model analysis: parameter breakdowns, FLOP counts that include attention, and how the
attention layers attend.

* :mod:`.params` -- parameters of the bottom-up network, the FPN and the head.
* :mod:`.flops` -- fvcore's ``FlopCountAnalysis`` with attention counted by the papers'
  algorithmic formulas (see that module for the exact convention).
* :mod:`.model_stats` -- both for a config, with its paper's numbers (:mod:`.paper`):
  ``tools/analyze_model.py``.
* :mod:`.attention_stats` -- how the attention layers attend and learn: per-layer attention
  perplexity (effective number of keys attended) and gradient/weight ratios of the relative
  embeddings, with forward hooks for a whole model.

Timing and peak memory are :mod:`aadet.benchmark`'s; the docs' tables and cost estimates are the
project's own machinery (``dev/``).
"""
# Each module's __all__ is its public API, re-exported here as it stands (one list per module).
from .attention_stats import *  # noqa: F401,F403
from .flops import *  # noqa: F401,F403
from .params import *  # noqa: F401,F403
