"""The AA and SASA papers' COCO RetinaNet numbers, keyed by our config file names.

Sources (all RetinaNet trained from scratch, 640x640, FLOPs = 2 x multiply-adds):

* AA: Bello et al., "Attention Augmented Convolutional Networks", ICCV 2019, Table 4
  (params, GFLOPs, mAP) and Table 7 (position-encoding ablation, mAP only).
* SASA: Ramachandran et al., "Stand-Alone Self-Attention in Vision Models", NeurIPS 2019,
  Table 2 (FPN + heads conv or attention; backbone conv-stem + attention or full attention).

Configs without a paper counterpart (e.g. the 2D-sine AA ablation, which the AA paper only ran
on ImageNet, and the demo configs) have no entry.
"""

import collections
import os
from typing import Dict, Optional

__all__ = ["PaperNumbers", "PAPER_NUMBERS", "paper_numbers"]

PaperNumbers = collections.namedtuple("PaperNumbers", ["params_m", "gflops", "map", "source"])
PaperNumbers.__doc__ = """A paper's row: params (millions), GFLOPs (2 per MAC), COCO mAP, where."""

PAPER_NUMBERS: Dict[str, PaperNumbers] = {
    "retinanet_R_50_FPN_scratch_150ep": PaperNumbers(33.4, 182, 36.8, "AA T4 (SASA T2: 36.5 mAP)"),
    "aa_retinanet_R_50_FPN_scratch_150ep": PaperNumbers(33.1, 182, 38.2, "AA T4"),
    "retinanet_R_101_FPN_scratch_150ep": PaperNumbers(52.4, 243, 38.5, "AA T4"),
    "aa_retinanet_R_101_FPN_scratch_150ep": PaperNumbers(51.7, 245, 39.2, "AA T4"),
    "aa_retinanet_R_50_FPN_scratch_150ep_pos_none": PaperNumbers(None, None, 37.7, "AA T7"),
    "aa_retinanet_R_50_FPN_scratch_150ep_pos_coordconv": PaperNumbers(None, None, 37.4, "AA T7"),
    "sasa_convstem_retinanet_R_50_FPN_scratch_150ep": PaperNumbers(25.9, 173, 36.8, "SASA T2"),
    "sasa_attnstem_retinanet_R_50_FPN_scratch_150ep": PaperNumbers(25.9, 173, 36.2, "SASA T2"),
    "sasa_convstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep": PaperNumbers(
        22.0, 111, 36.6, "SASA T2"
    ),
    "sasa_attnstem_retinanet_R_50_attnFPN_attnhead_scratch_150ep": PaperNumbers(
        22.0, 110, 36.6, "SASA T2"
    ),
}


def paper_numbers(config_file: str) -> Optional[PaperNumbers]:
    """The paper's numbers for a config path or name (``.yaml`` optional), or None."""
    name = os.path.splitext(os.path.basename(config_file))[0]
    return PAPER_NUMBERS.get(name)
