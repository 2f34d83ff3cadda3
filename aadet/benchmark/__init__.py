"""Speed and memory of detectors and layers, measured: what ``tools/benchmark.py`` runs, and what a
user imports to time a model of their own (the role ``torch.utils.benchmark`` has for kernels).

* :mod:`.timing`: timed calls with device synchronization, peak memory per device, AMP settings,
  and each case in a fresh Python process of its own (its allocator state cannot inflate another
  case's peak): the one place beside :mod:`aadet.utils.collect_env` where ``aadet`` runs a program.
* :mod:`.synthetic_batch`, :mod:`.training_step`: a random detection batch and one training step
  (forward with losses, backward, optimizer step) on it, the same for every model.
* :mod:`.step_profile`: one call under ``torch.profiler``, its device time by operator and kind
  of work (attention, conv, matmul, norm, copies): what bounds a measured ratio.
* :mod:`.report`: ratios to a baseline, markdown tables and JSON of the results.

Nothing here is imported by ``import aadet``.
"""
