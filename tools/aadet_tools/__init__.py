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
* :mod:`.synthetic_batch`, :mod:`.training_step` -- the random detection batch and the one
  training step (forward with losses, backward, optimizer step) that the benchmark tools time.
"""
import importlib
import sys

# Issue 45 moved these modules out of aadet. tools/gpu_check.py and aadet_tools/gpu_report.py
# still import the old names (their rewrite is on another branch): until they import the new
# ones, the old names resolve to the moved modules. Nothing else may use them; remove this then.
_MOVED = {
    "aadet.analysis.report": "aadet_tools.report",
    "aadet.analysis.timing": "aadet_tools.timing",
    "aadet.analysis.synthetic_batch": "aadet_tools.synthetic_batch",
    "aadet.utils.run_summary": "aadet_tools.run_summary",
}
for _old, _new in _MOVED.items():
    sys.modules.setdefault(_old, importlib.import_module(_new))
