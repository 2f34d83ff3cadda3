"""Run summaries: the few kilobytes that make a training figure re-runnable.

Every training of ``tools/train_net.py`` writes ``<OUTPUT_DIR>/run_summary.json`` when it ends
(:class:`RunSummaryHook`, which the script registers; an ``--eval-only`` run writes one too,
:func:`write_run_summary`); the runs a document cites are copied into
``docs/runs/`` (``dev/record_demo_results.py``), and every number of ``docs/demo_results.json``
and of the docs' tables is computed from those copies (a test checks it). A summary holds::

    {"format": 1,
     "config_file": "configs/Demo/trees_R_26_slim_FPN.yaml",   # relative to the repository
     "opts": ["SEED", "42", ...],                               # command-line overrides
     "config_sha256": "...",          # sha256 of the full resolved config (cfg.dump())
     "config_diff": {"MODEL.RESNETS.DEPTH": 26, ...},  # every key that differs from the defaults
     "seed": 42,
     "commit": "60289aa...", "dirty": false,            # git HEAD of the code that ran
     "machine": {"cpu": "AMD EPYC 7B13", "cpu_count": 2, "torch_threads": 2, "gpu": null,
                 "torch": "2.14.1", "python": "3.11.9"},
     "eval_only": false,              # true: an evaluation of MODEL.WEIGHTS, no training
     "iterations": 756, "train_seconds": 251.3,         # wall time of the training loop
     "load_average": [2.1, 2.0, 1.7],   # os.getloadavg() at its end (counts idle-priority work too)
     "cpu_seconds": 480.2,   # CPU time of the training process over the same span (all threads)
     "metrics": {"trees_val": {"AP": 14.2, "AP50": 47.3, "AP75": 3.9}, "trees_test": {...}}}

Reading a summary needs no model: tests and tools read them with plain json.
"""
import hashlib
import json
import logging
import os
import time
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from detectron2.engine import HookBase
from detectron2.utils import comm

from ..utils.collect_env import git_commit, machine_description

__all__ = [
    "SUMMARY_FILE",
    "FORMAT",
    "NOT_RECIPE_KEYS",
    "BOX_METRICS",
    "config_diff",
    "box_metrics_by_dataset",
    "last_box_metrics",
    "make_summary",
    "write_summary",
    "load_summary",
    "load_summaries",
    "write_run_summary",
    "RunSummaryHook",
]

#: Under "aadet", the logger that tools/train_net.py sets up (the message reaches its log.txt).
logger = logging.getLogger("aadet.run_summary")

#: The file name of a run's summary, in its OUTPUT_DIR and (renamed) under docs/runs/.
SUMMARY_FILE = "run_summary.json"
#: Bumped when the layout above changes.
FORMAT = 1
#: The COCO box metrics a summary keeps per dataset.
BOX_METRICS = ("AP", "AP50", "AP75")

#: Keys that say where a run executes or writes, not what it trains or evaluates: left out of
#: ``config_diff`` and of the recipe overrides that group runs (``dev/aadet_dev/demo_results.py``).
#: ``MODEL.WEIGHTS`` of an evaluation-only run names the training run it evaluates.
NOT_RECIPE_KEYS = frozenset(
    {"OUTPUT_DIR", "SEED", "MODEL.DEVICE", "DATALOADER.NUM_WORKERS", "MODEL.WEIGHTS"}
)


def _flatten(node, prefix="") -> Dict[str, object]:
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def config_diff(cfg, defaults) -> Dict[str, object]:
    """Every key of ``cfg`` whose value differs from ``defaults`` (both yacs/Detectron2 configs),
    flattened (``"MODEL.RESNETS.DEPTH": 26``), without the keys that do not change what is
    trained (output folder, seed, device, loader workers)."""
    a, b = _flatten(cfg), _flatten(defaults)
    return {
        k: v for k, v in sorted(a.items())
        if b.get(k, object()) != v and k not in NOT_RECIPE_KEYS
    }


def box_metrics_by_dataset(results: Mapping, datasets: Sequence[str]) -> Dict[str, Dict[str, float]]:
    """``{dataset: {"AP", "AP50", "AP75"}}`` from what Detectron2's ``DefaultTrainer.test``
    returns: ``{"bbox": {...}}`` for one dataset, ``{name: {"bbox": {...}}}`` for several."""
    if len(datasets) == 1 and "bbox" in results:
        results = {datasets[0]: results}
    out = {}
    for name in datasets:
        box = results.get(name, {}).get("bbox")
        if box is None:
            raise ValueError(f"no bbox results for {name!r} in {sorted(results)}")
        out[name] = {k: round(float(box[k]), 4) for k in BOX_METRICS}
    return out


def last_box_metrics(metrics_json: str, dataset: Optional[str] = None) -> Dict[str, float]:
    """The last ``AP``/``AP50``/``AP75`` of ``dataset`` in a run's ``metrics.json``.

    Detectron2 writes ``bbox/AP50`` when a run evaluates one dataset and ``<name>/bbox/AP50``
    when it evaluates several; ``dataset`` picks one of several (None: the only one).
    """
    with open(metrics_json) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prefix = f"{dataset}/bbox/" if dataset else "bbox/"
    evals = [r for r in rows if prefix + "AP50" in r]
    if not evals and dataset:  # a run that evaluated only this dataset
        prefix = "bbox/"
        evals = [r for r in rows if prefix + "AP50" in r]
    if not evals:
        raise ValueError(f"{metrics_json}: no {prefix}AP50 row (the run was not evaluated)")
    return {k: evals[-1][prefix + k] for k in BOX_METRICS}


def make_summary(
    *,
    config_file: str,
    opts: Iterable[str],
    cfg_dump: str,
    diff: Dict[str, object],
    seed: int,
    repo: str,
    iterations: int,
    train_seconds: float,
    metrics: Dict[str, Dict[str, float]],
    eval_only: bool = False,
) -> Dict[str, object]:
    """A summary dict (layout in the module docstring). ``config_file`` is stored relative to
    ``repo`` when it lies inside it."""
    path = os.path.abspath(config_file) if config_file else ""
    if path and os.path.commonpath([path, os.path.abspath(repo)]) == os.path.abspath(repo):
        path = os.path.relpath(path, repo)
    return {
        "format": FORMAT,
        "config_file": path.replace(os.sep, "/"),
        "opts": [str(o) for o in opts],
        "config_sha256": hashlib.sha256(cfg_dump.encode()).hexdigest(),
        "config_diff": diff,
        "seed": int(seed),
        **git_commit(repo),
        "machine": machine_description(),
        "eval_only": bool(eval_only),
        "iterations": int(iterations),
        "train_seconds": round(float(train_seconds), 1),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "metrics": metrics,
    }


def write_summary(summary: Mapping, path: str) -> None:
    """Write ``summary`` as indented json, atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def load_summary(path: str) -> Dict[str, object]:
    """Read one summary; ValueError naming the file if it is not one."""
    with open(path) as f:
        data = json.load(f)
    missing = [k for k in ("format", "config_file", "seed", "metrics", "machine") if k not in data]
    if missing:
        raise ValueError(f"{path}: not a run summary (missing {missing})")
    if data["format"] != FORMAT:
        raise ValueError(f"{path}: summary format {data['format']}, expected {FORMAT}")
    return data


def load_summaries(folder: str) -> List[Dict[str, object]]:
    """Every ``*.json`` summary under ``folder`` (recursively), sorted by path; each gets its
    path relative to ``folder`` as ``"_file"``."""
    out = []
    for dirpath, _, names in sorted(os.walk(folder)):
        for n in sorted(names):
            if n.endswith(".json"):
                full = os.path.join(dirpath, n)
                s = load_summary(full)
                s["_file"] = os.path.relpath(full, folder).replace(os.sep, "/")
                out.append(s)
    return out


# ----------------------------------------------------------------------------- a run's summary
def _aadet_checkout() -> str:
    """The checkout whose commit a summary records: the one ``aadet`` is imported from (the code
    that trained)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_run_summary(
    cfg, config_file: str, opts, results, *, iterations: int = 0, train_seconds: float = 0.0,
    start_iter: int = 0, eval_only: bool = False, cpu_seconds: Optional[float] = None,
) -> str:
    """Write ``<cfg.OUTPUT_DIR>/run_summary.json`` of a run of ``cfg``, made from ``config_file``
    and ``opts``, whose last evaluation returned ``results`` (``DefaultTrainer.test``'s dict, or
    None); returns its path."""
    from .defaults import get_aadet_cfg

    metrics = box_metrics_by_dataset(results, cfg.DATASETS.TEST) if results else {}
    summary = make_summary(
        config_file=config_file,
        opts=opts,
        cfg_dump=cfg.dump(),
        diff=config_diff(cfg, get_aadet_cfg()),
        seed=cfg.SEED,
        repo=_aadet_checkout(),
        iterations=iterations,
        train_seconds=train_seconds,
        metrics=metrics,
        eval_only=eval_only,
    )
    summary["start_iter"] = start_iter
    if cpu_seconds is not None:  # CPU time of the training process (all its threads)
        summary["cpu_seconds"] = round(cpu_seconds, 1)
    os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
    path = os.path.join(cfg.OUTPUT_DIR, SUMMARY_FILE)
    write_summary(summary, path)
    logger.info("Run summary: %s", path)
    return path


class RunSummaryHook(HookBase):
    """A Detectron2 hook: write ``<OUTPUT_DIR>/run_summary.json`` after training
    (:func:`write_run_summary`). ``tools/train_net.py`` registers it after the trainer's own
    hooks (``trainer.register_hooks``), so its ``after_train`` reads the final evaluation that
    the evaluation hooks' ``after_train`` ran.

    ``train_seconds`` is the wall time from the first to the end of the last iteration of this
    process (a resumed run counts its own part; ``start_iter`` says where it began), without the
    final evaluation. Metrics are the last evaluation's (``trainer.last_eval_results``), per
    dataset of ``DATASETS.TEST``; a run without one writes ``"metrics": {}``. Only the main
    process writes.

    Args:
        config_file, opts: how the config was made (``tools/train_net.py``'s ``--config-file``
            and overrides), recorded so that the run can be repeated.
    """

    def __init__(self, config_file: str, opts):
        self._config_file = config_file
        self._opts = list(opts)
        self._t0 = None
        self._seconds = None

    def before_train(self):
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def after_step(self):
        if self.trainer.iter == self.trainer.max_iter - 1:
            self._seconds = time.perf_counter() - self._t0
            self._cpu_seconds = time.process_time() - self._cpu0

    def after_train(self):
        if not comm.is_main_process() or self._seconds is None:
            return  # not the writer, or training stopped before its last iteration
        t = self.trainer
        write_run_summary(
            t.cfg, self._config_file, self._opts, getattr(t, "last_eval_results", None),
            iterations=t.max_iter - t.start_iter, train_seconds=self._seconds,
            start_iter=t.start_iter, cpu_seconds=self._cpu_seconds,
        )
