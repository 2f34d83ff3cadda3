"""Shared code of the project's tools: report rendering, run recording; not part of the installed aadet.

``python tools/<tool>.py`` puts ``tools/`` on ``sys.path``, so a tool imports this package as
``from aadet_tools import gpu_report``; the tests have ``tools`` on their path (``pytest.ini``).
It may import :mod:`aadet`; :mod:`aadet` never imports it.

* :mod:`.gpu_report` -- ``tools/gpu_check.py``'s report: the benchmark protocol and targets,
  ``docs/benchmarks_cuda.json``, the stages' merge and its verdicts.
* :mod:`.cpu_report` -- ``tools/benchmark_cpu.py``'s report on the same rows and targets.
* :mod:`.run_summary` -- a run's ``run_summary.json``: its format, reading, writing, and the hook
  that ``tools/train_net.py`` registers to write it.
* :mod:`.timing`, :mod:`.report` -- the benchmarks' timing, peak memory, AMP settings and worker
  processes; their ratios, markdown and JSON.
* :mod:`.benchmark_tables` -- the markdown tables of ``tools/benchmark.py``,
  ``tools/benchmark_layers.py`` and ``tools/profile_step.py`` (printed by them, rendered into
  BENCHMARKS.md from the committed runs).
* :mod:`.synthetic_batch`, :mod:`.training_step` -- the random detection batch and the one
  training step (forward with losses, backward, optimizer step) that the benchmark tools time.
* :mod:`.checkout` -- whether a tree (with or without ``.git``) is the clean commit it claims.
* :mod:`.demo_results`, :mod:`.model_table`, :mod:`.paper`, :mod:`.cost`, :mod:`.generated_docs`
  -- the docs' generated tables (``tools/update_docs.py``).
* :mod:`.prepare_trees` -- the demo data, read from the deepforest wheel (``tools/prepare_demo_data.py``).
"""
