"""Shared code of the project's tools: report rendering, run recording; not part of the installed aadet.

``python tools/<tool>.py`` puts ``tools/`` on ``sys.path``, so a tool imports this package as
``from aadet_tools import gpu_report``; the tests have ``tools`` on their path (``pytest.ini``).
It may import :mod:`aadet`; :mod:`aadet` never imports it.

* :mod:`.gpu_report` -- ``tools/gpu_check.py``'s report: the benchmark protocol and targets,
  ``docs/benchmarks_cuda.json``, the stages' merge and its verdicts.
* :mod:`.cpu_report` -- ``tools/benchmark_cpu.py``'s report on the same rows and targets.
"""
