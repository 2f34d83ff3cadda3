#!/usr/bin/env python
"""Check COCO-format detection datasets, print their box statistics and the recipe they suggest.

    python tools/check_dataset.py datasets/trees/annotations/trees_val.json datasets/trees/val
    python tools/check_dataset.py cells/train.json cells/images cells/val.json cells/images \\
        --base configs/Demo/trees_R_26_slim_FPN.yaml --write configs/cells.yaml

Arguments are JSON IMAGE_ROOT pairs, one per split; the FIRST is the training split, whose boxes
set the suggested anchors, aspect ratios and sizes (``aadet/data/statistics.py`` has the rule).

Checks (``aadet/data/checks.py``), one problem per line; exit status 1 on errors. Errors:
missing/corrupt images, sizes that differ from the json, degenerate or out-of-image boxes, unknown
image/category ids, duplicate ids, missing keys. Info: images without boxes, grayscale or RGBA.

``--write CONFIG`` writes a config that ``_BASE_``s ``--base`` and adds the suggestion,
``DATASETS.REGISTER_COCO`` for every pair (named after the json files; paths as given here, so
train from this working directory or give absolute paths), ``DATASETS.TRAIN`` (first pair),
``DATASETS.TEST`` (second pair, else the first) and ``MODEL.RETINANET.NUM_CLASSES``; the norm of
the backbone and FPN follows the base's batch per worker (rule 5 of ``aadet/data/statistics.py``;
the written config says which and why). A base whose
horizontal flip is not the papers' gets ``INPUT.SCALE_JITTER.FLIP_PROB`` back to the papers' value:
the tree demos (``Base-Trees.yaml``) mirror every training tile because their val image faces the
other way (shadows, crowns leaning off-nadir), a choice that belongs to the demo's images, not to
yours.
"""

import argparse
import os
import sys

from aadet.data.checks import check_coco_json
from aadet.data.statistics import (
    format_statistics,
    load_coco_boxes,
    strides_of,
    suggest_recipe,
    to_yaml_lines,
)


def _pairs(values, parser):
    if len(values) % 2:
        parser.error(f"expected JSON IMAGE_ROOT pairs; got {len(values)} paths: {values}")
    return [(values[i], values[i + 1]) for i in range(0, len(values), 2)]


def _base_settings(base):
    """``(strides, octaves, crop_size, images_per_worker)`` the suggestion must fit, from the base
    config (its batch: ``SOLVER.IMS_PER_BATCH`` for ``SOLVER.REFERENCE_WORLD_SIZE`` workers, 0 =
    one), and ``flip``: ``(base's, papers')`` horizontal flip probabilities when they differ, else
    None."""
    from aadet.engine import get_aadet_cfg

    cfg = get_aadet_cfg()
    papers_flip = float(cfg.INPUT.SCALE_JITTER.FLIP_PROB)
    cfg.merge_from_file(base)
    base_flip = float(cfg.INPUT.SCALE_JITTER.FLIP_PROB)
    return (
        strides_of(cfg.MODEL.RETINANET.IN_FEATURES),
        len(cfg.MODEL.ANCHOR_GENERATOR.SIZES[0]),
        int(cfg.INPUT.SCALE_JITTER.CROP_SIZE),
        max(1, cfg.SOLVER.IMS_PER_BATCH // max(1, cfg.SOLVER.REFERENCE_WORLD_SIZE)),
        (base_flip, papers_flip) if base_flip != papers_flip else None,
    )


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _flip_note(flip) -> str:
    return (f"INPUT.SCALE_JITTER.FLIP_PROB back to the papers' {flip[1]} (the base's {flip[0]} "
            "was chosen for its own data).")


def write_config(path, base, pairs, names, stats, recipe, flip=None):
    """Write the config of the module docstring to ``path``; returns its text. ``flip``:
    ``(base's, papers')`` flip probabilities to reset the base's to the papers' (None: keep)."""
    train = stats[0]
    rel_base = os.path.relpath(os.path.abspath(base), os.path.dirname(os.path.abspath(path)))
    keys = _merge(
        {
            "OUTPUT_DIR": f"output/{os.path.splitext(os.path.basename(path))[0]}",
            "DATASETS": {
                "REGISTER_COCO": [[n, j, r] for n, (j, r) in zip(names, pairs)],
                "TRAIN": [names[0]],
                "TEST": [names[1] if len(names) > 1 else names[0]],
            },
            "MODEL": {"RETINANET": {"NUM_CLASSES": train.num_classes}},
        },
        recipe.config_dict(),
    )
    flip_lines = []
    if flip is not None:
        keys = _merge(keys, {"INPUT": {"SCALE_JITTER": {"FLIP_PROB": flip[1]}}})
        flip_lines = [f"# {_flip_note(flip)}"]
    header = [
        f"# Written by tools/check_dataset.py for {pairs[0][0]}: {len(train.image_wh)} images, "
        f"{len(train.wh)} boxes, sizes sqrt(w*h) {train.sizes.min():.1f}-{train.sizes.max():.1f} px.",
        f"# Test scale {recipe.scale:.2f}x; anchors, aspect ratios (h/w) and sizes from the box "
        "statistics (aadet/data/statistics.py).",
        *(f"# NOTE: {n}" for n in recipe.notes),
        *flip_lines,
        f'_BASE_: "{rel_base}"',
    ]
    text = "\n".join(header + to_yaml_lines(keys)) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", metavar="JSON IMAGE_ROOT",
                        help="COCO detection json and the folder its file_name are relative to; "
                        "one pair per split, the training split first")
    parser.add_argument("--errors-only", action="store_true", help="do not print info lines")
    parser.add_argument("--no-stats", action="store_true", help="only check, no statistics")
    parser.add_argument("--base", default=None,
                        help="config the suggestion must fit (its FPN levels, anchors per level, "
                        "crop size), e.g. configs/Demo/trees_R_26_slim_FPN.yaml")
    parser.add_argument("--write", default=None, metavar="CONFIG",
                        help="write a config that _BASE_s --base with the suggestion and datasets")
    args = parser.parse_args(argv)
    pairs = _pairs(args.paths, parser)
    if args.write and not args.base:
        parser.error("--write needs --base (the config to build on)")
    if args.base and not os.path.isfile(args.base):
        parser.error(f"--base: config file not found: {args.base}")

    n_errors = 0
    for json_file, image_root in pairs:
        problems = check_coco_json(json_file, image_root)
        errors = [p for p in problems if p.level == "error"]
        n_errors += len(errors)
        for p in problems:
            if p.level == "error" or not args.errors_only:
                print(p)
        print(f"{json_file}: {len(errors)} error(s), {len(problems) - len(errors)} info",
              file=sys.stderr)
    if n_errors or args.no_stats:
        if n_errors and args.write:
            print(f"not writing {args.write}: fix the errors first", file=sys.stderr)
        return 1 if n_errors else 0

    names = [os.path.splitext(os.path.basename(j))[0] for j, _ in pairs]
    if len(set(names)) != len(names):
        parser.error(f"the json files must have different names (they name the datasets): {names}")
    stats = [load_coco_boxes(j, n) for (j, _), n in zip(pairs, names)]
    print("\n# Box statistics (pixels, as stored; sqrt(w*h) is the object size)")
    for s in stats:
        print("\n".join(format_statistics(s)))
    strides, octaves, crop, per_worker, flip = (8, 16, 32), 3, 640, None, None
    if args.base:
        strides, octaves, crop, per_worker, flip = _base_settings(args.base)
    try:
        recipe = suggest_recipe(stats[0], strides=strides, octaves=octaves, max_crop_size=crop,
                                images_per_worker=per_worker)
    except ValueError as e:
        print(f"no suggestion: {e}", file=sys.stderr)
        return 1
    print(f"\n# Suggested for {names[0]} (FPN strides {list(strides)}, test scale "
          f"{recipe.scale:.2f}x); paste into your config:")
    print("\n".join(recipe.yaml_lines()))
    for note in recipe.notes:
        print(f"# NOTE: {note}")
    if flip is not None:
        print(f"# NOTE: {_flip_note(flip)}")
    if args.write:
        write_config(args.write, args.base, pairs, names, stats, recipe, flip)
        from aadet.engine import load_config

        load_config(args.write)  # the written config must load (and register its datasets)
        print(f"\nwrote {args.write}; train with\n  python tools/train_net.py --config-file "
              f"{args.write} --num-gpus 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
