"""Building an aadet config the same way in every tool, and the training scripts' command line
(Detectron2's ``engine/defaults.py`` holds both too)."""
import logging
import os
import re
import sys
from typing import Optional, Sequence

import torch
import yaml
from detectron2.config import get_cfg
from detectron2.engine import default_argument_parser

from ..config import (
    UnknownConfigKeyError,
    add_aadet_config,
    similar_config_keys,
    validate_aadet_config,
)
from ..data.datasets import register_coco_from_config
from .launch import add_launch_arguments, launch

__all__ = ["get_aadet_cfg", "load_config", "parse_args_with_opts", "training_argument_parser", "launch_from_args"]

logger = logging.getLogger(__name__)

# yacs' message for a key the config does not have: KeyError from merge_from_file, AssertionError
# from merge_from_list.
_NON_EXISTENT_KEY = re.compile(r"^Non-existent (?:config )?key: (\S+)$")


def get_aadet_cfg():
    """Detectron2's defaults plus aadet's keys (unfrozen)."""
    cfg = get_cfg()
    add_aadet_config(cfg)
    return cfg


def load_config(config_file: str = "", opts=(), *, freeze: bool = True):
    """``get_aadet_cfg()`` + a YAML file + ``KEY VALUE`` overrides, validated.

    ``MODEL.DEVICE`` "cuda" on a machine without CUDA falls back to "cpu" with a warning, so the
    same YAML serves GPU clusters and a laptop. The datasets of ``DATASETS.REGISTER_COCO`` are
    registered here, so every tool can use a dataset named only in the config.

    Raises:
        UnknownConfigKeyError: (a ``KeyError``) a key the config does not have, naming the file
            that sets it (or the command line) and the nearest existing keys.
    """
    cfg = get_aadet_cfg()
    if config_file:
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"config file not found: {config_file}")
        try:
            cfg.merge_from_file(config_file)
        except KeyError as e:
            key = _non_existent_key(e)
            if key is None:
                raise
            source = _file_setting(config_file, key)
            raise UnknownConfigKeyError(key, source, similar_config_keys(cfg, key)) from None
    try:
        cfg.merge_from_list(list(opts))
    except AssertionError as e:
        key = _non_existent_key(e)
        if key is None:
            raise
        raise UnknownConfigKeyError(key, None, similar_config_keys(cfg, key)) from None
    if cfg.MODEL.DEVICE.startswith("cuda") and not torch.cuda.is_available():
        logger.warning("MODEL.DEVICE=%s but CUDA is not available: using cpu", cfg.MODEL.DEVICE)
        cfg.MODEL.DEVICE = "cpu"
    validate_aadet_config(cfg)
    register_coco_from_config(cfg)  # DATASETS.REGISTER_COCO, before anything reads DATASETS.*
    if freeze:
        cfg.freeze()
    return cfg


def _non_existent_key(error: Exception) -> Optional[str]:
    """The key of yacs' "Non-existent key" error, or ``None`` for any other error."""
    match = _NON_EXISTENT_KEY.match(str(error.args[0])) if error.args else None
    return match.group(1) if match else None


def _file_setting(config_file: str, key: str) -> str:
    """The file among ``config_file`` and its ``_BASE_`` files (fvcore's rule: a path relative to
    the file naming it) that sets ``key``; ``config_file`` itself when none is found to."""
    missing = object()
    todo = [config_file]
    while todo:
        path = todo.pop(0)
        try:
            with open(path) as f:
                node = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            continue
        base = node.get("_BASE_", []) if isinstance(node, dict) else []
        for name in key.split("."):
            node = node.get(name, missing) if isinstance(node, dict) else missing
        if node is not missing:
            return path
        for b in [base] if isinstance(base, str) else base:
            b = os.path.expanduser(b)
            todo.append(b if b.startswith("/") else os.path.join(os.path.dirname(path), b))
    return config_file


#: A config key on a command line (``SEED``, ``MODEL.AA.KAPPA``): where the overrides begin.
_CONFIG_KEY = re.compile(r"^[A-Z][A-Z0-9_]*(\.[A-Z][A-Z0-9_]*)*$")


def parse_args_with_opts(parser, argv: Optional[Sequence[str]] = None):
    """``parser.parse_args(argv)`` for a command whose config overrides (its positional ``opts``,
    ``argparse.REMAINDER``) may follow an option of several values (``--configs A B``,
    ``--size H W``), which argparse would give every word up to the next option
    (``--size 800 MODEL.AA.KAPPA 0.25`` would read the key as a size): the overrides begin at the
    first word that is a config key and not the value of an option of one value (``--output-json
    OUT``); the words before it are parsed, those from it on are ``opts``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    one_value = {o for a in parser._actions if a.nargs is None and a.option_strings for o in a.option_strings}
    start = next((i for i, word in enumerate(argv)
                  if _CONFIG_KEY.match(word) and not (i and argv[i - 1] in one_value)), len(argv))
    args = parser.parse_args(argv[:start])
    args.opts = list(args.opts or []) + argv[start:]
    return args


def training_argument_parser(weights: str):
    """The command line of ``tools/train_net.py`` and ``tools/lazyconfig_train_net.py``:
    Detectron2's ``default_argument_parser()``, the launch flags (:func:`~.launch.add_launch_arguments`)
    and ``--allow-mismatched-weights``; ``weights`` names where the weights come from (the
    config key, for the help text)."""
    parser = add_launch_arguments(default_argument_parser())
    parser.add_argument(
        "--allow-mismatched-weights",
        action="store_true",
        help=f"start training from {weights} even if its keys/shapes differ from the model "
        "(mismatched parameters keep their initialization); without it a mismatch is an error",
    )
    return parser


def launch_from_args(main, args) -> None:
    """Run ``main(args)`` in the processes ``args`` asks for (:func:`~.launch.launch`: ``--num-gpus``,
    ``--num-machines``, ``--machine-rank``, ``--dist-url``, ``--dist-timeout``, ``--launcher``)."""
    logging.getLogger("aadet").info("Command Line Args: %s", args)
    launch(
        main,
        args.num_gpus,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        dist_url=args.dist_url,
        args=(args,),
        timeout_s=args.dist_timeout,
        launcher=args.launcher,
    )
