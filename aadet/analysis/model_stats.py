"""A config's parameters and FLOPs, next to its paper's numbers: what ``tools/analyze_model.py``
prints and the model table of the docs shows.

:func:`analyze_model` counts a model already built from its config: parameters (total; bottom-up /
FPN / head, :mod:`.params`) and FLOPs at ``size x size`` (the papers' FLOPs, 2 per multiply-add,
and the attention share, :mod:`.flops`), with the paper's params / GFLOPs / COCO mAP
(:mod:`.paper`). :func:`analyze_config` loads the config and builds the model first.
"""
import dataclasses
import glob
import os
from typing import Dict, List, Optional, Sequence, Tuple

from .flops import detector_flops, flop_breakdown
from .paper import PaperNumbers, paper_numbers
from .params import parameter_breakdown

__all__ = ["ModelStats", "list_configs", "config_key", "analyze_model", "analyze_config"]


@dataclasses.dataclass
class ModelStats:
    """A config's parameters and FLOPs and the paper's numbers (unrounded; MACs, not FLOPs)."""

    config: str  # path relative to the configs/ folder, without ".yaml"
    params: Dict[str, int]
    flops: Optional[Dict[str, int]]  # {"backbone","fpn","head","total","attention","overhead"} MACs
    size: Tuple[int, int]
    paper: Optional[PaperNumbers]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["paper"] = self.paper._asdict() if self.paper is not None else None
        if self.flops is not None:
            d["paper_gflops"] = 2 * self.flops["total"] / 1e9
        return d


def list_configs(config_root: str) -> List[str]:
    """Every model config under ``config_root`` (recursively), ``Base-*.yaml`` excluded, sorted."""
    paths = glob.glob(os.path.join(config_root, "**", "*.yaml"), recursive=True)
    return sorted(p for p in paths if not os.path.basename(p).startswith("Base-"))


def config_key(config_file: str) -> str:
    path = os.path.abspath(config_file)
    parts = path.split(os.sep)
    if "configs" in parts:
        rel = os.path.join(*parts[len(parts) - parts[::-1].index("configs") :])
    else:
        rel = os.path.basename(path)
    return os.path.splitext(rel)[0]


def analyze_model(
    config_file: str,
    cfg,
    model,
    size: Optional[Tuple[int, int]] = None,
    *,
    flops: bool = True,
) -> "ModelStats":
    """Count the parameters of ``model`` (and its FLOPs at ``size``): the row of ``config_file``.

    ``cfg`` is the config loaded from ``config_file`` and ``model`` the detector built from it (in
    eval mode); ``config_file`` names the row and finds the papers' numbers. ``size=None``: the
    config's test size, ``INPUT.MAX_SIZE_TEST`` square (640 for the COCO configs: the papers' size;
    448 for the demo).
    """
    if size is None:
        size = (cfg.INPUT.MAX_SIZE_TEST, cfg.INPUT.MAX_SIZE_TEST)
    params = parameter_breakdown(model)
    fl = None
    if flops:
        report = detector_flops(model, size[0], size[1])
        fl = flop_breakdown(report)
        fl.update(
            attention=report.attention,
            overhead=report.overhead,
            padded_h=report.input_size[0],
            padded_w=report.input_size[1],
        )
        if report.unsupported_ops:
            fl["unsupported_ops"] = report.unsupported_ops  # type: ignore[assignment]
    return ModelStats(config_key(config_file), params, fl, tuple(size), paper_numbers(config_file))


def analyze_config(
    config_file: str,
    size: Optional[Tuple[int, int]] = None,
    *,
    flops: bool = True,
    opts: Sequence[str] = (),
) -> "ModelStats":
    """The row of ``config_file`` (:func:`analyze_model`): its model built on CPU in eval mode
    with seed 0, ``opts`` overriding the config."""
    import torch
    from detectron2.modeling import build_model

    from ..engine import load_config

    cfg = load_config(config_file, ["MODEL.DEVICE", "cpu", *opts])
    torch.manual_seed(0)
    return analyze_model(config_file, cfg, build_model(cfg).eval(), size, flops=flops)
