#!/usr/bin/env python
"""Attention maps of an AA layer (the AA paper's Figure 10): for an image and a few pixels, the
attention distribution of every head of one augmented convolution, heads as rows, pixels as columns.

  python tools/visualize_attention.py --config-file CFG --weights W --image img.png \
      --pixels 120,200 300,310 [--layer backbone.bottom_up.res4.0.conv2] --output attention.png

Pixels are ``x,y`` in the original image. Without ``--layer`` the first augmented conv of res4 is used;
``--list-layers`` prints the model's AA layers.
"""
import argparse

import numpy as np
import torch

import aadet  # noqa: F401
from aadet.engine import Predictor
from aadet.engine.tool_config import load_any_config
from aadet.layers import AugmentedConv2d
from aadet.utils.images import read_image, to_rgb


def aa_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, AugmentedConv2d)}


def parse_pixel(text):
    try:
        x, y = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"pixel must be 'x,y' integers; got {text!r}")
    return x, y


def attention_for_pixels(predictor, layer, image, pixels):
    """``(maps [Nh, P, h, w] as numpy, (h, w), valid (hv, wv))`` for ``pixels`` (x, y) of ``image``."""
    captured = {}

    def keep_input(module, inputs, output):  # returns None: the output is left alone
        captured["x"] = inputs[0]

    handle = layer.register_forward_hook(keep_input)
    try:
        predictor(image)
    finally:
        handle.remove()
    x = captured["x"]  # [1, Fin, Hf, Wf], the layer input for the padded, resized image
    H, W = image.shape[:2]
    resized = predictor.aug.get_transform(image)
    rh, rw = resized.new_h, resized.new_w
    h, w = layer.attention_grid_size(x.shape[-2], x.shape[-1])
    # the model input is the resized image padded to the backbone's size divisibility
    stride = max(1, predictor.model.backbone.size_divisibility)
    ph, pw = int(np.ceil(rh / stride) * stride), int(np.ceil(rw / stride) * stride)
    query = []
    for px, py in pixels:
        if not (0 <= px < W and 0 <= py < H):
            raise ValueError(f"pixel ({px},{py}) outside the {W}x{H} image")
        ry, rx = py * rh / H, px * rw / W  # in the resized image
        query.append((min(h - 1, int(ry / ph * h)), min(w - 1, int(rx / pw * w))))
    with torch.no_grad():
        maps = layer.attention_maps(x, torch.tensor(query))[0]  # [Nh, P, h, w]
    valid = (max(1, round(rh / ph * h)), max(1, round(rw / pw * w)))  # grid rows/cols on the image
    return maps.float().cpu().numpy(), (h, w), valid


def render(rgb, maps, valid, pixels, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nh, p = maps.shape[:2]
    H, W = rgb.shape[:2]
    fig, axes = plt.subplots(nh, p, figsize=(2.2 * p, 2.2 * nh), squeeze=False)
    for i in range(nh):
        for j in range(p):
            ax = axes[i][j]
            m = maps[i, j, : valid[0], : valid[1]]
            ax.imshow(rgb.mean(axis=2), cmap="gray", extent=(0, W, H, 0))
            ax.imshow(m, cmap="jet", alpha=0.55, extent=(0, W, H, 0), interpolation="nearest")
            ax.plot([pixels[j][0]], [pixels[j][1]], "r+", markersize=12, mew=2)
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(f"head {i}")
            if i == 0:
                ax.set_title(f"pixel {j + 1} ({pixels[j][0]},{pixels[j][1]})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--image")
    ap.add_argument("--pixels", nargs="+", type=parse_pixel, default=[])
    ap.add_argument("--layer", default=None, help="module name of an AugmentedConv2d")
    ap.add_argument("--list-layers", action="store_true")
    ap.add_argument("--output", default="attention.png")
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)

    cfg = load_any_config(args.config_file, args.opts)
    predictor = Predictor(cfg, args.weights)
    layers = aa_layers(predictor.model)
    if not layers:
        ap.error(f"{args.config_file} has no AugmentedConv2d layer (not an AA model)")
    if args.list_layers:
        print("\n".join(layers))
        return None
    if args.layer is None:
        args.layer = next((n for n in layers if ".res4." in n), next(iter(layers)))
    if args.layer not in layers:
        ap.error(f"--layer {args.layer!r} is not an AA layer; choose from: {', '.join(layers)}")
    if not args.image or not args.pixels:
        ap.error("--image and --pixels are required")
    image = read_image(args.image, predictor.input_format)
    maps, _, valid = attention_for_pixels(predictor, layers[args.layer], image, args.pixels)
    render(to_rgb(image, predictor.input_format), maps, valid, args.pixels, args.output)
    print(f"{args.output}: {maps.shape[0]} heads x {maps.shape[1]} pixels of {args.layer}")
    return args.output, maps


if __name__ == "__main__":
    main()
