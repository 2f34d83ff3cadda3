"""Detectron2's other config system: LazyConfig files (``configs/**/*.py``) for aadet's models.

A LazyConfig file is plain Python that Detectron2's ``LazyConfig.load`` runs; its ``model``,
``dataloader``, ``optimizer``, ``lr_multiplier`` and ``train`` are trees of ``L(callable)(args)``
calls and plain values (``configs/common/``: aadet's pieces). This module gives them what the
YACS configs have (:mod:`aadet.engine.defaults`, :mod:`aadet.engine.trainer`):

* :func:`load_lazy_config`: ``LazyConfig.load`` plus command-line overrides (``key=value``,
  Detectron2's syntax) where a key the config does not have, and that the call it would go to does
  not take by name, stops with :class:`~aadet.config.UnknownConfigKeyError` naming the nearest
  keys (:func:`~aadet.config.similar_config_keys`, as for YACS); ``train.device`` "cuda" falls back
  to "cpu" without CUDA; ``dataloader.register_coco`` registers your own data
  (:func:`~aadet.data.datasets.register_coco_entries`, as ``DATASETS.REGISTER_COCO``).
* :func:`build`: Detectron2's ``instantiate``; a call that fails (the builders' and layers'
  own checks: out-of-range values, unknown names) stops with
  :class:`LazyBuildError` naming the key of the call and, where the message names an argument,
  the full key of that argument (``model.backbone.bottom_up.attention.kernel_size``).
* :func:`apply_lazy_epoch_schedule`: ``train.epochs`` / ``steps_epochs`` / ``warmup_epochs`` to
  ``train.max_iter`` / ``steps`` / ``warmup_iters`` (:func:`~aadet.engine.schedule.epoch_schedule`,
  as ``SOLVER.EPOCHS``), which ``lr_multiplier`` interpolates.
* :class:`LazyTrainer` and :func:`lazy_test`: Detectron2's ``tools/lazyconfig_train_net.py`` loop
  with what :class:`~aadet.engine.trainer.Trainer` adds: strict atomic checkpoints, exact resume
  of the data stream, EMA of the weights, the best checkpoint, evaluation on every test split
  (``dataloader.test.dataset.names`` may list several, as ``DATASETS.TEST``), the hooks in the
  same order, so a run from a LazyConfig twin repeats the YACS run for the same seed.
"""
import contextlib
import dataclasses
import inspect
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from pydoc import locate
from typing import List, Sequence

import torch
from detectron2.config import LazyConfig
from detectron2.engine import AMPTrainer, SimpleTrainer, hooks
from detectron2.evaluation import inference_on_dataset, print_csv_format
from detectron2.utils import comm
from detectron2.utils.events import CommonMetricPrinter, JSONWriter, TensorboardXWriter
from omegaconf import DictConfig, ListConfig, OmegaConf

from ..config import ConfigValueError, UnknownConfigKeyError, config_error, config_keys, similar_config_keys
from ..data.datasets import register_coco_entries
from ..layers.functional.checks import check_in
from ..utils.d2compat import cpu_safe_ddp_model, restart_loop_data_loader
from .checkpoint import AADetCheckpointer
from .ema import DECAY_RANGE, ModelEMA
from .hooks import AttentionStatsHook, EMAHook
from .rank_sync import check_ranks_agree, weights_fingerprint
from .schedule import epoch_schedule

__all__ = [
    "LazyBuildError",
    "plain_containers",
    "call_target",
    "load_lazy_config",
    "apply_overrides",
    "build",
    "apply_lazy_epoch_schedule",
    "eval_dataset_names",
    "lazy_test",
    "build_lazy_model_ema",
    "LazyTrainer",
    "evaluate_lazy_checkpoint",
]

logger = logging.getLogger(__name__)


class LazyBuildError(ConfigValueError):
    """A call of a LazyConfig failed while it was built; the message names its key."""


# ============================================================================ loading
def plain_containers(cfg):
    """``cfg`` as plain containers, interpolations unresolved (for walking its keys)."""
    return OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg


def call_target(node):
    """The callable of a call node (``_target_``, located if a name), else None."""
    target = node.get("_target_") if isinstance(node, Mapping) else None
    return locate(target) if isinstance(target, str) else target


def _takes_argument(node, name: str) -> bool:
    """Whether ``node`` is a call (``_target_``) whose callable takes ``name`` by name."""
    target = call_target(node)
    if target is None:
        return False
    try:
        param = inspect.signature(target).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)


def _key_exists(tree, key: str) -> bool:
    """``key`` names a value of ``tree`` (plain containers), or an argument its call takes."""
    node, parts = tree, key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return i == len(parts) - 1 and _takes_argument(node, part)
    return True


def apply_overrides(cfg, overrides: Sequence[str]):
    """Detectron2's ``LazyConfig.apply_overrides`` (``key=value``), refusing unknown keys.

    Raises:
        UnknownConfigKeyError: (a ``KeyError``) naming the key and the nearest existing ones.
    """
    for override in overrides:
        key = override.split("=", 1)[0].strip().lstrip("+~")
        tree = plain_containers(cfg)
        if not _key_exists(tree, key):
            raise UnknownConfigKeyError(key, None, similar_config_keys(tree, key))
        LazyConfig.apply_overrides(cfg, [override])
    return cfg


def load_lazy_config(config_file: str, overrides: Sequence[str] = ()):
    """``LazyConfig.load(config_file)`` + checked ``key=value`` overrides; the device falls back to
    CPU without CUDA; ``dataloader.register_coco`` (``[name, json_file, image_root]`` triples)
    registered (see the module docstring)."""
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"config file not found: {config_file}")
    cfg = apply_overrides(LazyConfig.load(config_file), overrides)
    train = cfg.get("train")
    if train is not None and str(train.get("device", "cpu")).startswith("cuda") and not torch.cuda.is_available():
        logger.warning("train.device=%s but CUDA is not available: using cpu", train.device)
        train.device = "cpu"
    entries = plain_containers(cfg.get("dataloader", {}).get("register_coco", []))
    if isinstance(entries, list):  # ListConfig entries are plain lists now
        entries = [list(e) if isinstance(e, (list, tuple)) else e for e in entries]
    register_coco_entries(entries, "dataloader.register_coco")
    return cfg


# ============================================================================ building
def _argument_keys(node, key: str, message: str) -> List[str]:
    """Keys under ``key`` whose last name is the first word of ``message`` (the argument an
    ``argument_error`` names, e.g. ``kernel_size must be ...``)."""
    words = message.split()
    if not words:
        return []
    name = words[0].strip("'\":,")
    tree = plain_containers(node)
    keys = config_keys(tree, key + ".") if isinstance(tree, Mapping) else []
    found = [k for k in keys if k.rsplit(".", 1)[-1] == name]
    return found or ([f"{key}.{name}"] if _takes_argument(tree, name) else [])


def build(node, key: str = ""):
    """Detectron2's ``instantiate(node)``; ``key`` is ``node``'s key (``"model"``).

    Raises:
        LazyBuildError: a call raised ``ValueError``/``TypeError``/``AssertionError``; the
            message names the call's key, its callable, and the argument's key when the error
            names one.
    """
    if isinstance(node, ListConfig):
        return ListConfig([build(x, f"{key}.{i}") for i, x in enumerate(node)], flags={"allow_objects": True})
    if isinstance(node, list):
        return [build(x, f"{key}.{i}") for i, x in enumerate(node)]
    if isinstance(node, DictConfig) and dataclasses.is_dataclass(node._metadata.object_type):
        return OmegaConf.to_object(node)  # a dataclass (ShapeSpec)
    if not (isinstance(node, Mapping) and "_target_" in node):
        return node
    kwargs = {k: build(v, f"{key}.{k}" if key else k) for k, v in node.items() if k != "_target_"}
    target = call_target(node)
    name = getattr(target, "__qualname__", str(target))
    try:
        return target(**kwargs)
    except LazyBuildError:
        raise
    except (ValueError, TypeError, AssertionError) as e:
        arg_keys = _argument_keys(node, key, str(e))
        where = f"Config key {arg_keys[0]}" if len(arg_keys) == 1 else f"Config key {key}"
        raise LazyBuildError(f"{where} (building {key} = {name}(...)): {e}") from e


# ============================================================================ schedule
def apply_lazy_epoch_schedule(cfg, num_images: int = None):
    """``train.max_iter`` / ``steps`` / ``warmup_iters`` from ``train.epochs`` / ``steps_epochs``
    / ``warmup_epochs``, the training images (``dataloader.train.dataset``) and
    ``dataloader.train.total_batch_size``: :func:`~aadet.engine.schedule.epoch_schedule`, as
    ``SOLVER.EPOCHS`` is converted. No-op when ``train.epochs`` is 0 or absent."""
    t = cfg.train
    epochs = t.get("epochs", 0)
    if epochs < 0:
        raise config_error("train.epochs", ">= 0 (0 = use train.max_iter)", epochs)
    if epochs == 0:
        return cfg
    if num_images is None:
        num_images = len(build(cfg.dataloader.train.dataset, "dataloader.train.dataset"))
    batch = cfg.dataloader.train.total_batch_size
    t.max_iter, steps, warmup = epoch_schedule(
        epochs, list(t.get("steps_epochs", ())), num_images, batch, t.get("warmup_epochs", 0.0),
        key="train.steps_epochs",
    )
    t.steps = list(steps)
    if warmup is not None:
        t.warmup_iters = warmup
    logger.info(
        f"Epoch schedule: {epochs} epochs x {num_images} images / batch {batch} -> "
        f"train.max_iter={t.max_iter}, steps={tuple(t.steps)}, warmup_iters={t.get('warmup_iters')}"
    )
    return cfg


# ============================================================================ evaluation
def eval_dataset_names(cfg) -> List[str]:
    """The test splits: ``dataloader.test.dataset.names``, one name or a list."""
    names = cfg.dataloader.test.dataset.names
    return [names] if isinstance(names, str) else list(names)


@contextlib.contextmanager
def _set(node, **values):
    old = {k: node[k] for k in values if k in node}
    for k, v in values.items():
        node[k] = v
    try:
        yield
    finally:
        for k in values:
            if k in old:
                node[k] = old[k]
            else:
                del node[k]


def lazy_test(cfg, model):
    """Evaluate ``model`` on every test split (``dataloader.test`` built once per name, the
    evaluator writing to ``train.output_dir/inference/<name>``), as ``Trainer.test`` does for
    ``DATASETS.TEST``: ``{name: results}``, or the results alone for one split."""
    results = OrderedDict()
    test, evaluator = cfg.dataloader.test, cfg.dataloader.get("evaluator")
    if evaluator is None:
        return results
    for name in eval_dataset_names(cfg):
        out = os.path.join(cfg.train.output_dir, "inference", name)
        with _set(test.dataset, names=name), _set(evaluator, output_dir=out):
            loader = build(test, "dataloader.test")
            results[name] = inference_on_dataset(model, loader, build(evaluator, "dataloader.evaluator"))
        if comm.is_main_process():
            logger.info("Evaluation results for %s in csv format:", name)
            print_csv_format(results[name])
    return list(results.values())[0] if len(results) == 1 else results


# ============================================================================ training
def build_lazy_model_ema(cfg, model):
    """``ModelEMA(model, train.model_ema.decay)`` when ``train.model_ema.enabled``, else None."""
    ema = cfg.train.get("model_ema")
    if ema is None:  # a LazyConfig of Detectron2's own train.py: no EMA
        return None
    check_in(ema.decay, DECAY_RANGE, "train.model_ema.decay", config_error)
    return ModelEMA(model, ema.decay) if ema.enabled else None


def _device(cfg) -> str:
    return cfg.train.get("device", "cpu")


class LazyTrainer:
    """Training from a LazyConfig, as :class:`~aadet.engine.trainer.Trainer` trains from YACS.

    Builds, in the YACS trainer's order: ``model`` (on ``train.device``), ``optimizer`` (its
    ``params.model`` set to the model), ``dataloader.train``, DDP, the Detectron2 loop
    (``AMPTrainer`` with ``train.amp.enabled``), the strict atomic checkpointer, the hooks.
    """

    def __init__(self, cfg, *, strict: bool = True):
        self.cfg = cfg
        model = build(cfg.model, "model").to(_device(cfg))
        cfg.optimizer.params.model = model
        optimizer = build(cfg.optimizer, "optimizer")
        loader = build(cfg.dataloader.train, "dataloader.train")
        model = cpu_safe_ddp_model(model, **cfg.train.get("ddp", {}))
        loop = AMPTrainer if cfg.train.get("amp", {}).get("enabled", False) else SimpleTrainer
        self.loop = loop(model, loader, optimizer)
        self.model, self.max_iter, self.start_iter = model, cfg.train.max_iter, 0
        self.model_ema = build_lazy_model_ema(cfg, model)
        out = cfg.train.output_dir
        self.checkpointer = AADetCheckpointer(
            model, out, strict=strict, trainer=self.loop,
            **({"model_ema": self.model_ema} if self.model_ema is not None else {}),
        )
        self.last_eval_results = None
        self.loop.register_hooks(self.build_hooks())

    def evaluated_weights(self):
        """The moving average with ``train.model_ema.enabled``, the trained weights otherwise."""
        if self.model_ema is None:
            return contextlib.nullcontext(self.model)
        return self.model_ema.applied_to(self.model)

    def _evaluate(self):
        with self.evaluated_weights():
            self.last_eval_results = lazy_test(self.cfg, self.model)
        return self.last_eval_results

    def build_hooks(self):
        """The YACS trainer's hooks, in its order (``Trainer.build_hooks``)."""
        t = self.cfg.train
        main = comm.is_main_process()
        ret = [
            hooks.IterationTimer(),
            hooks.LRScheduler(scheduler=build(self.cfg.lr_multiplier, "lr_multiplier")),
            hooks.PeriodicCheckpointer(self.checkpointer, **t.checkpointer) if main else None,
            hooks.EvalHook(t.eval_period, self._evaluate),
        ]
        if self.model_ema is not None:
            ret.insert(0, EMAHook(self.model_ema))
        metric = t.get("best_checkpoint_metric", "")
        if metric and t.eval_period > 0 and eval_dataset_names(self.cfg):
            ret.append(hooks.BestCheckpointer(
                t.eval_period, self.checkpointer, metric, mode="max", file_prefix="model_best"
            ))
        if t.get("attention_stats_period", 0) > 0:
            ret.append(AttentionStatsHook(t.attention_stats_period))
        if main:
            out, period = t.output_dir, t.log_period
            writers = [
                CommonMetricPrinter(self.max_iter),
                JSONWriter(os.path.join(out, "metrics.json"), window_size=period),
                TensorboardXWriter(out),
            ]
            ret.append(hooks.PeriodicWriter(writers, period=period))
        return [h for h in ret if h is not None]

    def resume_or_load(self, resume: bool = True):
        """Load ``train.init_checkpoint``, or with ``resume`` the last checkpoint of
        ``train.output_dir`` (then the data stream continues where it stopped)."""
        self.checkpointer.resume_or_load(self.cfg.train.init_checkpoint, resume=resume)
        if resume and self.checkpointer.has_checkpoint():
            self.start_iter = self.loop.iter + 1
        if comm.get_world_size() > 1:
            check_ranks_agree(
                "where training starts (iteration, weights fingerprint)",
                (self.start_iter, weights_fingerprint(self.model)),
                "Every machine must load the same checkpoint (train.output_dir on a shared "
                "filesystem with --resume; train.init_checkpoint the same file on each).",
            )
        if self.start_iter > 0 and _takes_argument(self.cfg.dataloader.train, "start_iter"):
            train = self.cfg.dataloader.train
            restart_loop_data_loader(self.loop, lambda: self._restarted_loader(train))

    def _restarted_loader(self, train):
        with _set(train, start_iter=self.start_iter):
            return build(train, "dataloader.train")

    def train(self):
        """Run from ``start_iter`` to ``train.max_iter``; the last evaluation's results."""
        self.loop.train(self.start_iter, self.max_iter)
        return self.last_eval_results


def evaluate_lazy_checkpoint(cfg, resume: bool = False):
    """``--eval-only``: the model with ``train.init_checkpoint`` (or with ``resume`` the last
    checkpoint of ``train.output_dir``) loaded strictly -- the moving average with
    ``train.model_ema.enabled`` -- evaluated on every test split."""
    model = build(cfg.model, "model").to(_device(cfg))
    ema = cfg.train.get("model_ema", {}).get("enabled", False)
    AADetCheckpointer(model, save_dir=cfg.train.output_dir, strict=True, ema_weights=ema).resume_or_load(
        cfg.train.init_checkpoint, resume=resume
    )
    return lazy_test(cfg, model)
