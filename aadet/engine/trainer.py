"""The training loop of the papers' recipe, as a Detectron2 ``DefaultTrainer``.

Differences from ``DefaultTrainer``, each for a reason:
* train loader: the scale-jitter / crop / flip recipe (:mod:`aadet.data.augmentation`), on a
  stream that ``--resume`` continues exactly (:mod:`aadet.data.resumable`);
* evaluator: COCO box AP (Detectron2's compiled fast evaluator; ``COCOEvaluator`` falls back to
  pycocotools itself where it is not built);
* checkpoints: atomic writes, strict loading (:mod:`aadet.engine.checkpoint`), and the best
  checkpoint by ``SOLVER.BEST_CHECKPOINT_METRIC`` kept as ``model_best.pth``.
* multi-process training on CPU (gloo): Detectron2's ``create_ddp_model`` always passes
  ``device_ids=[local_rank]``, which PyTorch's DDP rejects for CPU modules;
* optimizer: ``SOLVER.OPTIMIZER`` (SGD as Detectron2's, or AdamW; :mod:`aadet.engine.optimizer`);
* metrics written every ``SOLVER.LOG_PERIOD`` iterations (Detectron2 hard-codes 20);
* with ``TEST.ATTENTION_STATS_PERIOD > 0``, per-layer attention statistics in the metrics
  (:class:`~aadet.engine.hooks.AttentionStatsHook`);
* with ``TEST.AUG.ENABLED``, a test-time-augmented evaluation after training as well
  (:meth:`Trainer.test_with_TTA`, results under ``bbox_TTA``), as Detectron2's ``train_net.py``
  does for R-CNNs, here for RetinaNet (:class:`~aadet.modeling.RetinaNetWithTTA`);
* with ``MODEL_EMA.ENABLED``, a moving average of the weights (:class:`~aadet.engine.ema.ModelEMA`,
  updated by :class:`~aadet.engine.hooks.EMAHook`, checkpointed as ``model_ema`` and restored by
  ``--resume``) is what every evaluation in training measures.
* with ``MODEL.COMPILE.ENABLED``, the model compiled in place by ``torch.compile``
  (:func:`~aadet.engine.compile.maybe_compile`, in :meth:`Trainer.build_model`: training and
  every evaluation, ``--eval-only`` too; checkpoints unchanged).
* with several processes, all ranks must load the same checkpoint (same start iteration and
  weights) and end with the same weights, else :class:`~aadet.engine.rank_sync.RanksDisagreeError`
  (:mod:`aadet.engine.rank_sync`: a machine that reads another ``OUTPUT_DIR`` fails at start).
The Detectron2 internals this needs are wrapped in :mod:`aadet.utils.d2compat`.
A NaN/inf loss stops training with the iteration: Detectron2's check on the losses, and
``AADetRetinaNet``'s on the head's predictions (before the GIoU loss asserts on NaN boxes).
"""
import contextlib
import logging
import os
import weakref
from collections import OrderedDict

from detectron2.data import DatasetMapper, build_detection_train_loader, get_detection_dataset_dicts
from detectron2.data.common import DatasetFromList
from detectron2.engine import DefaultTrainer, hooks
from detectron2.evaluation import COCOEvaluator
from detectron2.utils import comm
from detectron2.utils.events import CommonMetricPrinter, JSONWriter, TensorboardXWriter

from ..data.augmentation import build_augmentation
from ..data.resumable import PositionKeyedDataset, PositionSeededMapper, ResumableTrainingSampler
from ..modeling.test_time_augmentation import RetinaNetWithTTA
from ..utils.d2compat import ddp_without_device_ids_on_cpu, restart_data_loader, set_train_results
from .checkpoint import AADetCheckpointer
from .compile import maybe_compile
from .ema import build_model_ema
from .hooks import AttentionStatsHook, EMAHook
from .optimizer import build_optimizer
from .rank_sync import check_ranks_agree, weights_fingerprint

__all__ = ["Trainer"]


class Trainer(DefaultTrainer):
    """DefaultTrainer with the recipe's loader, COCO evaluation and safe checkpoints."""

    #: Set by ``tools/train_net.py --allow-mismatched-weights``: load MODEL.WEIGHTS even when its
    #: keys/shapes differ from the model (otherwise a mismatch is an error).
    allow_mismatched_weights = False

    # True while DefaultTrainer.build_hooks runs: its PeriodicWriter (period 20) is replaced.
    _defer_writers = False

    #: The moving average of the weights (``MODEL_EMA.ENABLED``), built by :meth:`build_hooks`.
    model_ema = None

    #: The last evaluation's results (``DefaultTrainer.test``'s dict), None before one.
    last_eval_results = None

    def __init__(self, cfg):
        with ddp_without_device_ids_on_cpu():
            super().__init__(cfg)

    @classmethod
    def build_model(cls, cfg):
        """Detectron2's model, compiled in place with ``MODEL.COMPILE.ENABLED``
        (:func:`~aadet.engine.compile.maybe_compile`; before DDP wraps it)."""
        return maybe_compile(super().build_model(cfg), cfg)

    @classmethod
    def build_train_loader(cls, cfg, start_iter: int = 0):
        """The recipe's loader; its stream starts at iteration ``start_iter`` (for resuming)."""
        dicts = get_detection_dataset_dicts(
            cfg.DATASETS.TRAIN, filter_empty=cfg.DATALOADER.FILTER_EMPTY_ANNOTATIONS
        )
        seed = cfg.SEED if cfg.SEED >= 0 else None  # None: shared random seed of this run
        sampler = ResumableTrainingSampler(
            len(dicts), seed=seed, start=start_iter * cfg.SOLVER.IMS_PER_BATCH
        )
        mapper = DatasetMapper(cfg, is_train=True, augmentations=build_augmentation(cfg, True))
        return build_detection_train_loader(
            dataset=PositionKeyedDataset(DatasetFromList(dicts, copy=False)),
            mapper=PositionSeededMapper(mapper, sampler.seed),
            sampler=sampler,
            total_batch_size=cfg.SOLVER.IMS_PER_BATCH,
            aspect_ratio_grouping=cfg.DATALOADER.ASPECT_RATIO_GROUPING,
            num_workers=cfg.DATALOADER.NUM_WORKERS,
        )

    def build_writers(self):
        """Detectron2's writers, with metrics.json smoothed over ``SOLVER.LOG_PERIOD`` iterations."""
        if self._defer_writers:
            return []  # DefaultTrainer.build_hooks' writer hook, replaced in build_hooks
        out = self.cfg.OUTPUT_DIR
        return [
            CommonMetricPrinter(self.max_iter),
            JSONWriter(os.path.join(out, "metrics.json"), window_size=self.cfg.SOLVER.LOG_PERIOD),
            TensorboardXWriter(out),
        ]

    def resume_or_load(self, resume=True):
        super().resume_or_load(resume=resume)
        if comm.get_world_size() > 1:
            check_ranks_agree(
                "where training starts (iteration, weights fingerprint)",
                (self.start_iter, weights_fingerprint(self.model)),
                f"Every machine must load the same checkpoint: with --resume, OUTPUT_DIR "
                f"({self.cfg.OUTPUT_DIR}) on a filesystem all machines share; MODEL.WEIGHTS the "
                "same file on each.",
            )
        if self.start_iter > 0:
            # Continue the data stream where the checkpointed run was, not from its start.
            restart_data_loader(self, lambda: self.build_train_loader(self.cfg, self.start_iter))

    def train(self):
        results = super().train()
        if comm.get_world_size() > 1:
            fingerprint = check_ranks_agree(
                "the trained weights (fingerprint)", weights_fingerprint(self.model),
                "DDP should keep the replicas equal: do not use these checkpoints before finding why.",
            )
            logging.getLogger(__name__).info(
                "Final weights fingerprint %s (rank %d), the same on all %d ranks",
                fingerprint, comm.get_rank(), comm.get_world_size(),
            )
        return results

    @classmethod
    def build_optimizer(cls, cfg, model):
        """``SOLVER.OPTIMIZER``: Detectron2's SGD or AdamW (:mod:`aadet.engine.optimizer`)."""
        return build_optimizer(cfg, model)

    @classmethod
    def build_evaluator(cls, cfg, dataset_name, output_folder=None):
        if output_folder is None:
            output_folder = os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
        return COCOEvaluator(
            dataset_name,
            tasks=("bbox",),
            distributed=True,
            output_dir=output_folder,
            use_fast_impl=True,  # without the compiled evaluator, COCOEvaluator uses pycocotools
        )

    @classmethod
    def test_with_TTA(cls, cfg, model):
        """Evaluate ``model`` with test-time augmentation (``TEST.AUG.*``) on ``DATASETS.TEST``;
        results keyed ``"<task>_TTA"`` (``bbox_TTA``), as in Detectron2's ``train_net.py``."""
        logging.getLogger(__name__).info(
            "Running inference with test-time augmentation: sizes %s, max %d, flip %s",
            tuple(cfg.TEST.AUG.MIN_SIZES), cfg.TEST.AUG.MAX_SIZE, cfg.TEST.AUG.FLIP,
        )
        evaluators = [
            cls.build_evaluator(cfg, name, os.path.join(cfg.OUTPUT_DIR, "inference_TTA", name))
            for name in cfg.DATASETS.TEST
        ]
        res = cls.test(cfg, RetinaNetWithTTA(cfg, model), evaluators)
        return OrderedDict((k + "_TTA", v) for k, v in res.items())

    def evaluated_weights(self):
        """Context in which ``self.model`` holds the weights that evaluations measure: the moving
        average with ``MODEL_EMA.ENABLED``, the trained weights otherwise."""
        if self.model_ema is None:
            return contextlib.nullcontext(self.model)
        return self.model_ema.applied_to(self.model)

    def _evaluate(self):
        # DefaultTrainer.build_hooks' test_and_save_results, on the evaluated weights.
        with self.evaluated_weights():
            self.last_eval_results = self.test(self.cfg, self.model)
        set_train_results(self, self.last_eval_results)  # what DefaultTrainer.train() returns
        return self.last_eval_results

    def _evaluate_with_TTA(self):
        with self.evaluated_weights():
            return self.test_with_TTA(self.cfg, self.model)

    def build_hooks(self):
        self.model_ema = build_model_ema(self.cfg, self.model)
        # Swap Detectron2's checkpointer for the atomic/strict one before hooks capture it.
        old = self.checkpointer
        self.checkpointer = AADetCheckpointer(
            old.model,
            old.save_dir,
            strict=not self.allow_mismatched_weights,
            save_to_disk=old.save_to_disk,
            trainer=weakref.proxy(self),
            **({"model_ema": self.model_ema} if self.model_ema is not None else {}),
        )
        self._defer_writers = True
        try:
            ret = super().build_hooks()
        finally:
            self._defer_writers = False
        # Detectron2 appends PeriodicWriter(build_writers(), period=20) on the main process only.
        # Detectron2's EvalHook calls test_and_save_results, which evaluates self.model as is.
        ret = [
            hooks.PeriodicWriter(self.build_writers(), period=self.cfg.SOLVER.LOG_PERIOD)
            if isinstance(h, hooks.PeriodicWriter)
            else hooks.EvalHook(self.cfg.TEST.EVAL_PERIOD, self._evaluate)
            if isinstance(h, hooks.EvalHook) else h
            for h in ret
        ]
        if self.model_ema is not None:
            # First: the average includes this iteration's step before anything checkpoints or
            # evaluates it (and IterationTimer counts the update in the iteration's time).
            ret.insert(0, EMAHook(self.model_ema))
        metric = self.cfg.SOLVER.BEST_CHECKPOINT_METRIC
        if metric and self.cfg.TEST.EVAL_PERIOD > 0 and len(self.cfg.DATASETS.TEST):
            idx = next(i for i, h in enumerate(ret) if isinstance(h, hooks.EvalHook))
            ret.insert(
                idx + 1,
                hooks.BestCheckpointer(
                    self.cfg.TEST.EVAL_PERIOD, self.checkpointer, metric, mode="max",
                    file_prefix="model_best",
                ),
            )
        period = self.cfg.TEST.ATTENTION_STATS_PERIOD
        # Before the writer, so that what these hooks put in the storage reaches metrics.json.
        extra = []
        if period > 0:
            extra.append(AttentionStatsHook(period))
        if self.cfg.TEST.AUG.ENABLED and len(self.cfg.DATASETS.TEST):  # after training (period 0)
            extra.append(hooks.EvalHook(0, self._evaluate_with_TTA))
        idx = next((i for i, h in enumerate(ret) if isinstance(h, hooks.PeriodicWriter)), len(ret))
        ret[idx:idx] = extra
        return ret
