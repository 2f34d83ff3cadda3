"""Config keys: schedule conversion and clear errors for bad values."""
import pytest

from aadet.config import ConfigValueError, validate_aadet_config
from aadet.engine import apply_epoch_schedule, epochs_to_iters, get_aadet_cfg, load_config


def test_epochs_to_iters_and_schedule():
    assert epochs_to_iters(150, 118287, 64) == 277236
    cfg = get_aadet_cfg()
    cfg.SOLVER.EPOCHS, cfg.SOLVER.STEPS_EPOCHS, cfg.SOLVER.IMS_PER_BATCH = 150, (100, 133), 64
    cfg.SOLVER.WARMUP_EPOCHS = 1
    apply_epoch_schedule(cfg, num_images=118287)
    assert cfg.SOLVER.MAX_ITER == 277236
    assert cfg.SOLVER.STEPS == (184824, 245816)
    assert cfg.SOLVER.WARMUP_ITERS == 1849
    cfg2 = get_aadet_cfg()
    cfg2.SOLVER.MAX_ITER = 1234
    apply_epoch_schedule(cfg2, num_images=10)  # EPOCHS = 0: iterations given directly
    assert cfg2.SOLVER.MAX_ITER == 1234


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("MODEL.RESNETS.NORM", "BatchNorm", "MODEL.RESNETS.NORM"),
        ("MODEL.FPN.NORM", "gn", "MODEL.FPN.NORM"),
        ("INPUT.SCALE_JITTER.LONG_SIDE_RANGE", (768, 512), "LONG_SIDE_RANGE"),
        ("INPUT.SCALE_JITTER.CROP_SIZE", 0, "CROP_SIZE"),
        ("INPUT.SCALE_JITTER.FLIP_PROB", 1.5, "FLIP_PROB"),
        ("SOLVER.EPOCHS", -1, "SOLVER.EPOCHS"),
        ("MODEL.FPN.P6P7_SOURCE", "c5", "P6P7_SOURCE"),
        ("MODEL.AA.KAPPA", 0.0, "MODEL.AA.KAPPA"),
        ("MODEL.AA.NU", 1.0, "MODEL.AA.NU"),
        ("MODEL.AA.POSITIONAL_ENCODING", "learned", "MODEL.AA.POSITIONAL_ENCODING"),
        ("MODEL.AA.STAGES", ("res6",), "MODEL.AA.STAGES"),
        ("MODEL.SASA.KERNEL_SIZE", 4, "MODEL.SASA.KERNEL_SIZE"),
        ("MODEL.SASA.STEM", "patchify", "MODEL.SASA.STEM"),
        ("MODEL.SASA.IMPL", "unfold", "MODEL.SASA.IMPL"),
    ],
)
def test_bad_values_name_the_key(key, value, needle):
    cfg = get_aadet_cfg()
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(ConfigValueError, match=needle.replace(".", r"\.")):
        validate_aadet_config(cfg)


def test_epoch_steps_must_lie_inside_training():
    cfg = get_aadet_cfg()
    cfg.SOLVER.EPOCHS, cfg.SOLVER.STEPS_EPOCHS = 10, (5, 12)
    with pytest.raises(ConfigValueError, match="STEPS_EPOCHS"):
        validate_aadet_config(cfg)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))
