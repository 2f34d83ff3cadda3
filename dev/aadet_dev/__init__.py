"""The shared code of the project's own machinery in ``dev/``: the GPU check's report, the CPU
report, run records and the docs' generated tables; not part of the installed ``aadet``.

``python dev/<script>`` puts ``dev/`` on ``sys.path``, so a script imports this package as
``from aadet_dev import gpu_report``; the tests have ``dev`` on their path (``pytest.ini``).
It imports :mod:`aadet` (the measuring is :mod:`aadet.benchmark`'s, a run's record
:mod:`aadet.engine.run_summary`'s); neither :mod:`aadet` nor ``tools/`` imports it.

* :mod:`.gpu_report` -- ``dev/gpu_check.py``'s report: the benchmark protocol and targets,
  ``docs/benchmarks_cuda.json``, the stages' merge and its verdicts.
* :mod:`.cpu_report` -- ``dev/benchmark_cpu.py``'s report on the same rows and targets.
* :mod:`.benchmark_tables` -- the markdown tables of ``dev/benchmark_layers.py`` and
  ``dev/profile_step.py`` (printed by them, rendered into BENCHMARKS.md from the committed runs).
* :mod:`.checkout` -- whether a tree (with or without ``.git``) is the clean commit it claims.
* :mod:`.demo_results`, :mod:`.model_table`, :mod:`.cost`, :mod:`.generated_docs` -- the docs'
  generated tables (``dev/update_docs.py``).
"""
