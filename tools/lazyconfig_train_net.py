#!/usr/bin/env python
"""Train / evaluate an aadet detector from a LazyConfig (Detectron2's ``lazyconfig_train_net.py``).

  python tools/lazyconfig_train_net.py --config-file configs/Demo/trees_R_26_slim_FPN.py --num-gpus 0
  python tools/lazyconfig_train_net.py --config-file configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.py \
      --num-gpus 8 dataloader.train.total_batch_size=32 train.output_dir=output/aa50
  python tools/lazyconfig_train_net.py --config-file CFG --eval-only train.init_checkpoint=W

Overrides are Detectron2's ``key=value``; a key the config does not have stops with the nearest
ones. What ``tools/train_net.py`` adds applies here too (``aadet/engine/lazy.py``): strict
checkpoint loading (``--allow-mismatched-weights`` to start from partial weights), ``--resume``
continuing the exact data stream, ``train.model_ema``, ``model_best.pth``, evaluation on every
split of ``dataloader.test.dataset.names``, your own data from ``dataloader.register_coco``, the
epoch schedule ``train.epochs``. The pieces: ``configs/common/``; docs/training.md, "LazyConfig".
"""
from detectron2.engine import default_setup
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

import aadet  # noqa: F401  (registers models and datasets)
from aadet.data import register_trees
from aadet.engine.defaults import launch_from_args, training_argument_parser
from aadet.engine.lazy import LazyTrainer, apply_lazy_epoch_schedule, evaluate_lazy_checkpoint, load_lazy_config


def main(args):
    register_trees()
    cfg = load_lazy_config(args.config_file, args.opts)
    setup_logger(cfg.train.output_dir, distributed_rank=comm.get_rank(), name="aadet")
    if not args.eval_only:
        apply_lazy_epoch_schedule(cfg)
    default_setup(cfg, args)  # output dir, logs, config.yaml, seed (train.seed)
    if args.eval_only:
        return evaluate_lazy_checkpoint(cfg, resume=args.resume)
    trainer = LazyTrainer(cfg, strict=not args.allow_mismatched_weights)
    trainer.resume_or_load(resume=args.resume)
    return trainer.train()


def build_parser():
    return training_argument_parser("train.init_checkpoint")


if __name__ == "__main__":
    launch_from_args(main, build_parser().parse_args())
