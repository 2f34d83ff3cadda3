"""Training hooks of aadet (Detectron2 ``HookBase``).

* :class:`AttentionStatsHook`: every ``period`` iterations, the attention layers' perplexity and
  the gradient/weight ratios of their relative embeddings, into the trainer's event storage (and
  from there metrics.json / TensorBoard). ``Trainer.build_hooks`` adds it when
  ``TEST.ATTENTION_STATS_PERIOD > 0``.
* :class:`EMAHook`: after every optimizer step, the moving average of the weights
  (:class:`~aadet.engine.ema.ModelEMA`); ``Trainer.build_hooks`` adds it when
  ``MODEL_EMA.ENABLED``.

* :class:`~.run_summary.RunSummaryHook` (in :mod:`.run_summary`, beside its file format): the
  run's ``run_summary.json`` after training; ``tools/train_net.py`` registers it.
"""
import logging

from detectron2.engine import HookBase

from ..analysis.attention_stats import (
    DEFAULT_MAX_QUERIES,
    AttentionStatsCollector,
    relative_embedding_grad_ratios,
)

__all__ = ["AttentionStatsHook", "EMAHook"]

logger = logging.getLogger(__name__)


class AttentionStatsHook(HookBase):
    """Per-layer attention statistics during training, every ``period`` iterations and at the last.

    On a due iteration it writes, for every attention layer of ``trainer.model``
    (:func:`aadet.analysis.attention_stats.attention_layers`, named by module path), with
    ``smoothing_hint=False`` (raw values, not a median over the log window):

    * ``attn/<layer>/perplexity`` and ``attn/<layer>/keys``: the effective number of keys
      attended and the number available (:class:`~aadet.analysis.attention_stats.AttentionStats`),
      measured in that iteration's training forward on the first image of the batch, under
      ``torch.no_grad()`` and on at most ``max_queries`` query pixels: forward hooks
      (:class:`~aadet.analysis.attention_stats.AttentionStatsCollector`) installed in
      ``before_step`` and removed in ``after_step``; each layer is measured at its first call, so
      the evaluation / PreciseBN forwards of other hooks' ``after_step`` do not count;
    * ``attn/<layer>/<param>_grad_ratio`` for ``rel_h``, ``rel_w``, ``rel`` (both tables),
      ``query`` and ``value``: ``||grad|| / ||weight||``
      (:func:`~aadet.analysis.attention_stats.relative_embedding_grad_ratios`).

    The gradients are read in ``after_step``: Detectron2's ``SimpleTrainer`` / ``AMPTrainer``
    zero them in the *next* ``run_step`` (before or after its forward), so in ``after_step``
    they are still this iteration's -- as the optimizer used them: after gradient clipping
    (``SOLVER.CLIP_GRADIENTS``) and, with AMP, unscaled by ``GradScaler.step``; the weights are
    those after the optimizer step. (Detectron2's ``after_backward`` would come earlier but
    ``DefaultTrainer`` does not forward it to its hooks.)

    A model without attention layers makes the hook a no-op.

    Args:
        period: iterations between measurements (``TEST.ATTENTION_STATS_PERIOD``), > 0.
        max_queries: query pixels per layer (see
            :func:`~aadet.analysis.attention_stats.attention_perplexity`).
    """

    def __init__(self, period: int, max_queries: int = DEFAULT_MAX_QUERIES):
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"AttentionStatsHook: period must be an integer >= 1; got {period!r}")
        self._period = period
        self._max_queries = max_queries
        self._collector = None

    def before_train(self):
        self._collector = AttentionStatsCollector(self.trainer.model, self._max_queries)
        if not self._collector.layers:
            logger.info("AttentionStatsHook: the model has no attention layers; nothing to record.")

    def _is_due(self) -> bool:
        next_iter = self.trainer.iter + 1
        return next_iter % self._period == 0 or next_iter == self.trainer.max_iter

    def before_step(self):
        if self._collector is not None and self._collector.layers and self._is_due():
            self._collector.start()

    def after_step(self):
        if self._collector is None or not self._collector.active:
            return
        stats = self._collector.stop()
        storage = self.trainer.storage
        for name, st in stats.items():
            storage.put_scalar(f"attn/{name}/perplexity", st.perplexity, smoothing_hint=False)
            storage.put_scalar(f"attn/{name}/keys", st.keys, smoothing_hint=False)
        for key, ratio in relative_embedding_grad_ratios(self.trainer.model).items():
            storage.put_scalar(f"attn/{key}_grad_ratio", ratio, smoothing_hint=False)

    def after_train(self):
        if self._collector is not None:
            self._collector.stop()


class EMAHook(HookBase):
    """Update ``ema`` (a :class:`~aadet.engine.ema.ModelEMA` of the trainer's model) after every
    iteration's optimizer step.

    Before training, an average that has not been updated yet (a new run, not a resumed one)
    restarts from the model's current weights: those loaded from ``MODEL.WEIGHTS``, not the
    initialization the average was built from.
    """

    def __init__(self, ema):
        self._ema = ema

    def before_train(self):
        if self._ema.updates == 0:
            self._ema.reset(self.trainer.model)

    def after_step(self):
        self._ema.update(self.trainer.model)
