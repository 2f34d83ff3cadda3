"""Config overrides after options of several values (``--configs A B``, ``--size H W``): the tools'
command lines end them at the first config key (``aadet.engine.defaults.parse_args_with_opts``)."""
import pytest

from tests.helpers import load_tool


@pytest.mark.parametrize("argv,configs,size,opts", [
    (["--config-file", "a.yaml", "--size", "800", "MODEL.AA.KAPPA", "0.25"], ["a.yaml"], [800],
     ["MODEL.AA.KAPPA", "0.25"]),
    (["--config-file", "a.yaml", "b.yaml", "SEED", "3", "MODEL.DEVICE", "cpu"], ["a.yaml", "b.yaml"], None,
     ["SEED", "3", "MODEL.DEVICE", "cpu"]),
    (["--config-file", "a.yaml", "--size", "480", "640"], ["a.yaml"], [480, 640], []),
    (["--config-file", "a.yaml", "--json", "out.json", "MODEL.CCNET.BOTTLENECK_KERNEL_SIZE", "1"], ["a.yaml"],
     None, ["MODEL.CCNET.BOTTLENECK_KERNEL_SIZE", "1"]),
    # an option's one value spelled like a config key is that option's value
    (["--config-file", "a.yaml", "--json", "OUT", "SEED", "1"], ["a.yaml"], None, ["SEED", "1"]),
])
def test_analyze_model_reads_overrides_after_several_values(argv, configs, size, opts):
    from aadet.engine.defaults import parse_args_with_opts

    tool = load_tool("analyze_model")
    args = parse_args_with_opts(tool.build_parser(), argv)
    assert (args.config_file, args.size, args.opts) == (configs, size, opts)


def test_argparse_alone_gives_the_key_to_the_option_before_it(capsys):
    with pytest.raises(SystemExit):
        load_tool("analyze_model").build_parser().parse_args(["--config-file", "a.yaml", "--size", "800",
                                                              "MODEL.AA.KAPPA", "0.25"])
    assert "argument --size: invalid int value: 'MODEL.AA.KAPPA'" in capsys.readouterr().err


def test_benchmark_reads_overrides_after_its_configs():
    from aadet.engine.defaults import parse_args_with_opts

    tool = load_tool("benchmark")
    args = parse_args_with_opts(tool.build_parser(), ["--configs", "a.yaml", "b.yaml", "--size", "256", "--compile",
                                                      "MODEL.COMPILE.BACKEND", "eager"])
    assert args.configs == ["a.yaml", "b.yaml"] and args.size == [256] and args.compile
    assert args.opts == ["MODEL.COMPILE.BACKEND", "eager"]
    args = parse_args_with_opts(tool.build_parser(), ["--configs", "a.yaml", "MODEL.AA.IMPL", "triton"])
    assert args.configs == ["a.yaml"] and args.opts == ["MODEL.AA.IMPL", "triton"]
