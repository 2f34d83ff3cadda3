#!/usr/bin/env python
"""Check a COCO-format detection dataset: every problem, one per line; exit status 1 on errors.

    python tools/check_dataset.py datasets/trees/annotations/trees_val.json datasets/trees/val

Errors: missing/corrupt images, sizes that differ from the json, degenerate or out-of-image boxes,
unknown image/category ids, duplicate ids, missing keys. Info: images without boxes, grayscale or
RGBA images. See ``aadet/data/checks.py``.
"""

import argparse
import sys

from aadet.data.checks import check_coco_json


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json_file", help="COCO detection json")
    parser.add_argument("image_root", help="folder that the images' file_name are relative to")
    parser.add_argument("--errors-only", action="store_true", help="do not print info lines")
    args = parser.parse_args(argv)
    problems = check_coco_json(args.json_file, args.image_root)
    errors = [p for p in problems if p.level == "error"]
    for p in problems:
        if p.level == "error" or not args.errors_only:
            print(p)
    print(
        f"{args.json_file}: {len(errors)} error(s), {len(problems) - len(errors)} info",
        file=sys.stderr,
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
