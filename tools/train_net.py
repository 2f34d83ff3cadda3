#!/usr/bin/env python
"""Train / evaluate an aadet detector with Detectron2 (same flags as Detectron2's train_net.py).

  python tools/train_net.py --config-file configs/Demo/trees_R_26_slim_FPN.yaml
  python tools/train_net.py --config-file configs/COCO-Detection/aa_retinanet_R_50_FPN_scratch_150ep.yaml \
      --num-gpus 8
  python tools/train_net.py --config-file CFG --eval-only MODEL.WEIGHTS output/model_final.pth
  python tools/train_net.py --config-file CFG --compile      # through torch.compile (MODEL.COMPILE)

Several machines, torchrun, SLURM, --dist-timeout: docs/multi_machine.md (aadet/engine/launch.py).
Every run writes ``OUTPUT_DIR/run_summary.json`` (config, seed, commit, machine, times, final
metrics): this script registers the hook, as Detectron2's training scripts add their own
(``aadet/engine/run_summary.py``).
"""
from detectron2.engine import default_setup
from detectron2.evaluation import verify_results
from detectron2.utils import comm
from detectron2.utils.logger import setup_logger

import aadet  # noqa: F401  (registers models and datasets)
from aadet.data import register_trees
from aadet.engine import AADetCheckpointer, Trainer, apply_epoch_schedule, load_config
from aadet.engine.compile import add_compile_argument, compile_opts
from aadet.engine.defaults import launch_from_args, training_argument_parser
from aadet.engine.run_summary import RunSummaryHook, write_run_summary


def config_opts(args):
    """The command line's ``KEY VALUE`` overrides, with those its flags stand for (``--compile``):
    what the config is made from and what the run summary records."""
    return list(args.opts) + compile_opts(args)


def setup(args):
    cfg = load_config(args.config_file, config_opts(args), freeze=False)
    setup_logger(cfg.OUTPUT_DIR, distributed_rank=comm.get_rank(), name="aadet")
    if not args.eval_only:
        apply_epoch_schedule(cfg)
    cfg.freeze()
    default_setup(cfg, args)
    return cfg


def main(args):
    register_trees()
    cfg = setup(args)
    if args.eval_only:
        model = Trainer.build_model(cfg)  # compiled with MODEL.COMPILE.ENABLED (--compile)
        # Strict: a checkpoint that does not match the config is an error, not random weights.
        # With MODEL_EMA.ENABLED, the weights evaluated are the checkpoint's moving average.
        AADetCheckpointer(
            model, save_dir=cfg.OUTPUT_DIR, strict=True, ema_weights=cfg.MODEL_EMA.ENABLED
        ).resume_or_load(cfg.MODEL.WEIGHTS, resume=args.resume)
        res = Trainer.test(cfg, model)
        if cfg.TEST.AUG.ENABLED:
            res.update(Trainer.test_with_TTA(cfg, model))
        if comm.is_main_process():
            verify_results(cfg, res)
            write_run_summary(cfg, args.config_file, config_opts(args), res, eval_only=True)
        return res

    Trainer.allow_mismatched_weights = args.allow_mismatched_weights
    trainer = Trainer(cfg)
    # After the trainer's own hooks: its after_train reads the final evaluation theirs ran.
    trainer.register_hooks([RunSummaryHook(args.config_file, config_opts(args))])
    trainer.resume_or_load(resume=args.resume)
    return trainer.train()


def build_parser():
    parser = training_argument_parser("MODEL.WEIGHTS")
    add_compile_argument(parser, "training and evaluation (the first iterations and the first evaluation "
                                 "include the compile time)")
    return parser


if __name__ == "__main__":
    launch_from_args(main, build_parser().parse_args())
