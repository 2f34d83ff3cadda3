"""``train``: what ``tools/lazyconfig_train_net.py`` reads besides the model, data and optimizer.

Detectron2's ``configs/common/train.py`` keys, plus aadet's: the epoch schedule (``epochs``,
``steps_epochs``, ``warmup_epochs``: converted to ``max_iter``, ``steps``, ``warmup_iters`` at start,
as ``SOLVER.EPOCHS``), ``best_checkpoint_metric``, ``model_ema``, ``attention_stats_period``,
``seed``. Every value is the YACS default of the same meaning (its key in the comment).
"""
from aadet.engine import get_aadet_cfg

_d = get_aadet_cfg()  # Detectron2's and aadet's defaults (aadet/config.py): the values' one home

train = dict(
    output_dir=_d.OUTPUT_DIR,  # OUTPUT_DIR
    init_checkpoint=_d.MODEL.WEIGHTS,  # MODEL.WEIGHTS
    epochs=_d.SOLVER.EPOCHS,  # SOLVER.EPOCHS (0: max_iter and steps as written)
    steps_epochs=list(_d.SOLVER.STEPS_EPOCHS),  # SOLVER.STEPS_EPOCHS
    warmup_epochs=_d.SOLVER.WARMUP_EPOCHS,  # SOLVER.WARMUP_EPOCHS (> 0 overrides warmup_iters)
    max_iter=_d.SOLVER.MAX_ITER,  # SOLVER.MAX_ITER
    steps=list(_d.SOLVER.STEPS),  # SOLVER.STEPS
    warmup_iters=_d.SOLVER.WARMUP_ITERS,  # SOLVER.WARMUP_ITERS
    amp=dict(enabled=_d.SOLVER.AMP.ENABLED),  # SOLVER.AMP.ENABLED
    # DefaultTrainer's create_ddp_model(model, broadcast_buffers=False)
    ddp=dict(broadcast_buffers=False, find_unused_parameters=False, fp16_compression=False),
    # DefaultTrainer's PeriodicCheckpointer keeps every checkpoint (max_to_keep None)
    checkpointer=dict(period=_d.SOLVER.CHECKPOINT_PERIOD, max_to_keep=None),
    eval_period=_d.TEST.EVAL_PERIOD,  # TEST.EVAL_PERIOD (0: once, after training)
    best_checkpoint_metric=_d.SOLVER.BEST_CHECKPOINT_METRIC,  # SOLVER.BEST_CHECKPOINT_METRIC
    log_period=_d.SOLVER.LOG_PERIOD,  # SOLVER.LOG_PERIOD
    attention_stats_period=_d.TEST.ATTENTION_STATS_PERIOD,  # TEST.ATTENTION_STATS_PERIOD
    model_ema=dict(enabled=_d.MODEL_EMA.ENABLED, decay=_d.MODEL_EMA.DECAY),  # MODEL_EMA.*
    device=_d.MODEL.DEVICE,  # MODEL.DEVICE ("cuda" falls back to "cpu" without CUDA)
    seed=_d.SEED,  # SEED (< 0: a random seed per run)
    cudnn_benchmark=_d.CUDNN_BENCHMARK,  # CUDNN_BENCHMARK
)
