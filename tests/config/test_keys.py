"""Config keys: schedule conversion, defaults from their owners and clear errors for bad values."""
import inspect
import os
import re

import pytest

from aadet.config import ConfigValueError, UnknownConfigKeyError, similar_config_keys, validate_aadet_config
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


def test_lr_step_rounding_onto_the_last_iteration_is_a_config_error():
    cfg = get_aadet_cfg()  # the demo's 62 tiles / 16 for 1 epoch: MAX_ITER 4, steps 3 and 4
    cfg.SOLVER.EPOCHS, cfg.SOLVER.STEPS_EPOCHS, cfg.SOLVER.IMS_PER_BATCH = 1, (0.75, 0.9), 16
    with pytest.raises(ConfigValueError, match=r"SOLVER.STEPS_EPOCHS.*MAX_ITER=4.*\(0.9, 4\)"):
        apply_epoch_schedule(cfg, num_images=62)


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("MODEL.RESNETS.NORM", "BatchNorm", "MODEL.RESNETS.NORM"),
        ("MODEL.FPN.NORM", "gn", "MODEL.FPN.NORM"),
        ("INPUT.SCALE_JITTER.LONG_SIDE_RANGE", (768, 512), "LONG_SIDE_RANGE"),
        ("INPUT.SCALE_JITTER.CROP_SIZE", 0, "CROP_SIZE"),
        ("INPUT.SCALE_JITTER.FLIP_PROB", 1.5, "FLIP_PROB"),
        ("INPUT.PHOTOMETRIC.CONTRAST", (1.2, 0.8), "INPUT.PHOTOMETRIC.CONTRAST must be"),
        ("SOLVER.EPOCHS", -1, "SOLVER.EPOCHS"),
        ("MODEL.AA.KAPPA", 0.0, "MODEL.AA.KAPPA"),
        ("MODEL.AA.NU", 1.0, "MODEL.AA.NU"),
        ("MODEL.AA.POSITIONAL_ENCODING", "learned", "MODEL.AA.POSITIONAL_ENCODING"),
        ("MODEL.SASA.KERNEL_SIZE", 4, "MODEL.SASA.KERNEL_SIZE"),
        ("MODEL.SASA.HEAD_KERNEL_SIZE", 0, "MODEL.SASA.HEAD_KERNEL_SIZE"),
        ("MODEL.SASA.IMPL", "unfold", "MODEL.SASA.IMPL"),
        ("MODEL.SASA.STEM_IMPL", "fused", "MODEL.SASA.STEM_IMPL"),
        ("MODEL.HALO.BLOCK_SIZE", 0, "MODEL.HALO.BLOCK_SIZE must be an integer >= 1; got 0"),
        ("MODEL.HALO.HALO_SIZE", -1, "MODEL.HALO.HALO_SIZE must be an integer >= 0; got -1"),
        ("MODEL.HALO.NUM_HEADS", 0, "MODEL.HALO.NUM_HEADS must be an integer >= 1; got 0"),
        ("MODEL.HALO.POSITIONAL_ENCODING", "sine2d", "MODEL.HALO.POSITIONAL_ENCODING"),
        ("MODEL.HALO.IMPL", "unfold", "MODEL.HALO.IMPL"),
    ],
)
def test_bad_values_name_the_key(key, value, needle):
    cfg = get_aadet_cfg()
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(ConfigValueError, match=re.escape(needle)):
        validate_aadet_config(cfg)


def test_recompute_attention_is_a_switch_for_routes_that_can():
    cfg = get_aadet_cfg()
    assert cfg.MODEL.SASA.RECOMPUTE_ATTENTION is False  # the layer's default
    for impl in ("auto", "cpp", "triton"):
        cfg.MODEL.SASA.IMPL, cfg.MODEL.SASA.RECOMPUTE_ATTENTION = impl, True
        validate_aadet_config(cfg)
    cfg.MODEL.SASA.IMPL = "neighborhood"
    with pytest.raises(ConfigValueError, match=re.escape(
            "Config key MODEL.SASA.RECOMPUTE_ATTENTION must be False with MODEL.SASA.IMPL='neighborhood'")):
        validate_aadet_config(cfg)
    cfg.MODEL.SASA.IMPL, cfg.MODEL.SASA.RECOMPUTE_ATTENTION = "auto", 1
    with pytest.raises(ConfigValueError, match=re.escape(
            "Config key MODEL.SASA.RECOMPUTE_ATTENTION must be True or False; got 1")):
        validate_aadet_config(cfg)


def test_epoch_steps_must_lie_inside_training():
    cfg = get_aadet_cfg()
    cfg.SOLVER.EPOCHS, cfg.SOLVER.STEPS_EPOCHS = 10, (5, 12)
    with pytest.raises(ConfigValueError, match="STEPS_EPOCHS"):
        validate_aadet_config(cfg)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_key_typo_in_a_file_names_the_file_and_the_nearest_key(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("MODEL:\n  SASA:\n    NUM_HEADS: 4\n")
    child = tmp_path / "child.yaml"
    child.write_text("_BASE_: base.yaml\nMODEL:\n  SASA:\n    KERNEL_SZE: 5\n")
    with pytest.raises(KeyError) as info:  # a KeyError, as yacs' own
        load_config(str(child))
    assert isinstance(info.value, UnknownConfigKeyError)
    assert str(info.value).startswith(
        f"Unknown config key MODEL.SASA.KERNEL_SZE in config file {child}; "
        "did you mean MODEL.SASA.KERNEL_SIZE?"
    )
    assert info.value.suggestions[0] == "MODEL.SASA.KERNEL_SIZE"
    # A typo in a _BASE_ file names that file; a misspelt section is matched as a whole key.
    base.write_text("MODEL:\n  SASSA:\n    NUM_HEADS: 4\n")
    child.write_text("_BASE_: base.yaml\nMODEL:\n  SASA:\n    KERNEL_SIZE: 5\n")
    needle = f"MODEL.SASSA in config file {base}; did you mean MODEL.SASA?"
    with pytest.raises(UnknownConfigKeyError, match=re.escape(needle)):
        load_config(str(child))


def test_key_typo_on_the_command_line_names_the_nearest_key():
    with pytest.raises(KeyError) as info:
        load_config("", ["MODEL.SASA.KERNEL_SZE", "5"])
    assert isinstance(info.value, UnknownConfigKeyError)
    assert str(info.value).startswith(
        "Unknown config key MODEL.SASA.KERNEL_SZE on the command line; did you mean MODEL.SASA.KERNEL_SIZE?"
    )
    needle = "SOLVER.BASE_LRR on the command line; did you mean SOLVER.BASE_LR?"
    with pytest.raises(UnknownConfigKeyError, match=re.escape(needle)):
        load_config("", ["SOLVER.BASE_LRR", "0.1"])
    needle = "MODEL.HALO.HALO_SZE on the command line; did you mean MODEL.HALO.HALO_SIZE?"
    with pytest.raises(UnknownConfigKeyError, match=re.escape(needle)):
        load_config("", ["MODEL.HALO.HALO_SZE", "3"])
    with pytest.raises(UnknownConfigKeyError, match="FOO.BAR on the command line; no existing key is close"):
        load_config("", ["FOO.BAR", "1"])
    with pytest.raises(AssertionError, match="odd length"):  # other yacs errors pass through
        load_config("", ["SOLVER.BASE_LR"])


def test_similar_config_keys():
    cfg = get_aadet_cfg()
    assert similar_config_keys(cfg, "MODEL.SASA.KERNEL_SZE")[0] == "MODEL.SASA.KERNEL_SIZE"
    assert similar_config_keys(cfg, "model.sasa.kernel_size")[0] == "MODEL.SASA.KERNEL_SIZE"  # case
    assert similar_config_keys(cfg, "MODEL.RESNET.DEPTH")[0] == "MODEL.RESNETS.DEPTH"
    assert similar_config_keys(cfg, "SEEED") == ["SEED"]
    assert "SOLVER" not in similar_config_keys(cfg, "SOLVER.LR")  # its own section is no answer
    assert similar_config_keys(cfg, "XYZZY.PLUGH") == []


def _owned_lists():
    from aadet.layers import HALO_ATTENTION_BACKENDS, LOCAL_ATTENTION_BACKENDS, SASA_POSITIONAL_ENCODINGS, STEM_IMPLS
    from aadet.modeling.backbone.fpn import FPN_SPATIAL_LAYER_REGISTRY, P6P7_SOURCES
    from aadet.modeling.backbone.resnet_stages import STAGE_NAMES
    from aadet.modeling.meta_arch.retinanet import RETINANET_HEAD_REGISTRY

    return {
        "MODEL.SASA.POSITIONAL_ENCODING": f"one of {SASA_POSITIONAL_ENCODINGS}",
        "MODEL.SASA.IMPL": f"one of {LOCAL_ATTENTION_BACKENDS.impls()}",
        "MODEL.SASA.STEM_IMPL": f"one of {STEM_IMPLS}",
        "MODEL.FPN.SPATIAL_LAYER": f"one of {tuple(sorted(n for n, _ in FPN_SPATIAL_LAYER_REGISTRY))}",
        "MODEL.FPN.P6P7_SOURCE": f"one of {P6P7_SOURCES}",
        "MODEL.RETINANET.HEAD_NAME": f"one of {tuple(sorted(n for n, _ in RETINANET_HEAD_REGISTRY))}",
        "MODEL.AA.DOWNSAMPLE_STAGES": f"a subset of {STAGE_NAMES}",
        "MODEL.HALO.IMPL": f"one of {HALO_ATTENTION_BACKENDS.impls()}",
        "MODEL.HALO.STAGES": f"a subset of {STAGE_NAMES}",
    }


@pytest.mark.parametrize(
    "key,value,when",
    [
        ("MODEL.SASA.POSITIONAL_ENCODING", "learned", "validated"),
        ("MODEL.SASA.IMPL", "unfold", "validated"),
        ("MODEL.SASA.STEM_IMPL", "fused", "validated"),
        # Keys whose allowed values belong to a model builder: checked when it maps them.
        ("MODEL.FPN.SPATIAL_LAYER", "transformer", "built"),
        ("MODEL.FPN.P6P7_SOURCE", "c5", "built"),
        ("MODEL.RETINANET.HEAD_NAME", "FCOSHead", "built"),
        ("MODEL.AA.DOWNSAMPLE_STAGES", ("res1",), "built"),
        ("MODEL.HALO.IMPL", "unfold", "validated"),
        ("MODEL.HALO.STAGES", ("res6",), "built:configs/Demo/trees_Halo_R_26_slim_FPN.yaml"),
    ],
)
def test_error_names_key_allowed_range_and_value(key, value, when):
    """The message has all three parts; the allowed lists are their owners' (the layers', the
    registries', the builders'), read when the check runs."""
    demo = "configs/Demo/trees_AA_R_26_slim_FPN.yaml"
    if when.startswith("built:"):
        when, demo = when.split(":")
    if when == "validated":
        cfg = get_aadet_cfg()
        cfg.merge_from_list([key, value])
        check = validate_aadet_config
    else:
        from detectron2.modeling import build_model
        from tests.helpers import REPO

        cfg = load_config(os.path.join(REPO, demo), ["MODEL.DEVICE", "cpu", key, str(value)])
        check = build_model
    with pytest.raises(ConfigValueError) as info:
        check(cfg)
    msg = str(info.value)
    assert msg.startswith(f"Config key {key} must be {_owned_lists()[key]}")
    assert repr(value) in msg
    assert isinstance(info.value, ValueError)


def test_allowed_values_come_from_their_owners():
    """The config accepts exactly what the layers and the route registries do."""
    from aadet.layers import (
        AA_POSITIONAL_ENCODINGS, HALO_ATTENTION_BACKENDS, HALO_POSITIONAL_ENCODINGS, LOCAL_ATTENTION_BACKENDS,
        LOGIT_TABLE_BACKENDS, SASA_POSITIONAL_ENCODINGS, STEM_IMPLS,
    )

    def accepted(key, candidates):
        ok = []
        for value in candidates:
            cfg = get_aadet_cfg()
            cfg.merge_from_list([key, value])
            try:
                validate_aadet_config(cfg)
                ok.append(value)
            except ConfigValueError:
                pass
        return ok

    junk = ["", "Relative", "absolute2d", "conv2"]
    assert accepted("MODEL.AA.POSITIONAL_ENCODING", list(AA_POSITIONAL_ENCODINGS) + ["absolute"] + junk) \
        == list(AA_POSITIONAL_ENCODINGS)
    assert accepted("MODEL.SASA.POSITIONAL_ENCODING", list(SASA_POSITIONAL_ENCODINGS) + ["absolute"] + junk) \
        == list(SASA_POSITIONAL_ENCODINGS)
    sasa, aa = LOCAL_ATTENTION_BACKENDS.impls(), LOGIT_TABLE_BACKENDS.impls()
    assert accepted("MODEL.SASA.IMPL", list(sasa) + junk) == list(sasa)
    assert accepted("MODEL.SASA.STEM_IMPL", list(STEM_IMPLS) + ["materialized"] + junk) == list(STEM_IMPLS)
    assert accepted("MODEL.AA.IMPL", list(aa) + junk) == list(aa)
    halo = HALO_ATTENTION_BACKENDS.impls()
    assert accepted("MODEL.HALO.IMPL", list(halo) + junk) == list(halo)
    assert accepted("MODEL.HALO.POSITIONAL_ENCODING", list(HALO_POSITIONAL_ENCODINGS) + ["sine2d"] + junk) \
        == list(HALO_POSITIONAL_ENCODINGS)


def test_layer_keys_default_to_the_layers_defaults(monkeypatch):
    """The layer keys' defaults are read from the layers' signatures: a changed signature changes
    the config, with nothing else to edit."""
    from aadet.layers import LocalSelfAttention2d

    assert get_aadet_cfg().MODEL.SASA.KERNEL_SIZE == get_aadet_cfg().MODEL.SASA.HEAD_KERNEL_SIZE == 7  # SASA: k = 7
    signature = inspect.signature(LocalSelfAttention2d)
    changed = signature.replace(parameters=[
        p.replace(default=5) if p.name == "kernel_size" else p for p in signature.parameters.values()
    ])
    monkeypatch.setattr(LocalSelfAttention2d, "__signature__", changed, raising=False)
    cfg = get_aadet_cfg()
    assert cfg.MODEL.SASA.KERNEL_SIZE == cfg.MODEL.SASA.HEAD_KERNEL_SIZE == 5


def test_halo_keys_are_the_layers_defaults_the_papers_values(monkeypatch):
    """MODEL.HALO.* default to HaloSelfAttention2d's signature, which holds HaloNet's values
    (b = 8, h = 3, 8 heads); a changed signature changes the config."""
    from aadet.config import layer_defaults
    from aadet.layers import HaloSelfAttention2d

    ha = get_aadet_cfg().MODEL.HALO
    assert (ha.BLOCK_SIZE, ha.HALO_SIZE, ha.NUM_HEADS, ha.POSITIONAL_ENCODING, ha.IMPL) == (8, 3, 8, "relative", "auto")
    defaults = layer_defaults(HaloSelfAttention2d)
    assert [defaults[k] for k in ("block_size", "halo_size", "num_heads")] == [8, 3, 8]
    signature = inspect.signature(HaloSelfAttention2d)
    changed = signature.replace(parameters=[
        p.replace(default=2) if p.name == "halo_size" else p for p in signature.parameters.values()
    ])
    monkeypatch.setattr(HaloSelfAttention2d, "__signature__", changed, raising=False)
    assert get_aadet_cfg().MODEL.HALO.HALO_SIZE == 2


def test_a_newly_registered_spatial_layer_is_accepted():
    """MODEL.FPN.SPATIAL_LAYER follows the registry, not a list of its own."""
    from detectron2.config import configurable

    from aadet.modeling.backbone.fpn import FPN_SPATIAL_LAYER_REGISTRY, spatial_layer_options

    cfg = get_aadet_cfg()
    cfg.MODEL.FPN.SPATIAL_LAYER = "test_identity_layer"
    with pytest.raises(ConfigValueError, match="MODEL.FPN.SPATIAL_LAYER"):
        spatial_layer_options(cfg)

    @FPN_SPATIAL_LAYER_REGISTRY.register("test_identity_layer")
    @configurable(from_config=lambda cfg: {"marker": 1})
    def keep_everything(fpn, marker):
        return fpn

    try:
        assert spatial_layer_options(cfg) == {"marker": 1}
        cfg.MODEL.FPN.SPATIAL_LAYER = "transformer"
        with pytest.raises(ConfigValueError, match="'test_identity_layer'"):
            spatial_layer_options(cfg)
    finally:
        FPN_SPATIAL_LAYER_REGISTRY._obj_map.pop("test_identity_layer")  # test cleanup only


def test_removed_keys_are_gone():
    """MODEL.AA.QUERY_CHUNK reached no code path a config could select: removed, and a YAML that
    still sets it is an error (yacs: non-existent key)."""
    cfg = get_aadet_cfg()
    assert "QUERY_CHUNK" not in cfg.MODEL.AA
    with pytest.raises(AssertionError, match="Non-existent key: MODEL.AA.QUERY_CHUNK"):
        cfg.merge_from_list(["MODEL.AA.QUERY_CHUNK", "16"])


def test_epoch_conversion_names_the_batch_key():
    with pytest.raises(ConfigValueError, match=r"Config key SOLVER\.IMS_PER_BATCH must be > 0; got 0"):
        epochs_to_iters(1, 10, 0)
