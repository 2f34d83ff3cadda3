"""The key grid's index made once per map size (aadet.layers.functional.key_grid), and what an AA
layer's call costs the host: at the 20x20 and 40x40 maps of AA-R50's res4-res5 every AA route took
the same 5-7 ms on the H200 (docs/runs/gpu/3a55981-h200, sweep), 4-8x the 3x3 conv, whatever the
route and the map: the time of the host launching ~200 operators, not of the kernels. These tests
keep the per-call work that is the same every time out of the call, and the host from waiting on
the device."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aadet.benchmark.step_profile import SYNC_OPS
from aadet.layers import AugmentedConv2d, HaloSelfAttention2d, LocalSelfAttention2d
from aadet.layers.functional import key_grid
from aadet.layers.functional.key_grid import row_col_tables_from_index
from aadet.layers.functional.key_grid import grid_indicators, grid_key_index, grid_of
from aadet.layers.functional.relative_attention import relative_logit_tables_2d


class _Dispatched(TorchDispatchMode):
    """Counts the operators dispatched while active, by name (``aten.mm``)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


#: Operators that make the host wait for the device on CUDA: the profile's host syncs, and
#: ``equal`` (on CUDA it ends in a ``_local_scalar_dense``, which on a CPU it never reaches).
HOST_WAITS = {name.replace("::", ".") for name in SYNC_OPS if name.startswith("aten::")} | {"aten.equal"}


def test_the_index_is_made_once_per_grid_and_recognized_by_identity():
    rows, cols = grid_key_index(3, 5, "cpu")
    assert torch.equal(rows, torch.arange(15) // 5) and torch.equal(cols, torch.arange(15) % 5)
    again = grid_key_index(3, 5, torch.device("cpu"))
    assert again[0] is rows and again[1] is cols
    assert grid_of([rows, cols]) == (3, 5, ("row", "col"))
    assert grid_of([cols]) == (3, 5, ("col",))
    assert grid_of([rows.clone(), cols]) is None  # equal contents, not the grid's: read as before
    assert grid_of([rows, grid_key_index(5, 3, "cpu")[1]]) is None  # two grids
    assert grid_of([]) is None


def test_the_row_col_kernels_learn_the_grid_without_reading_its_index(monkeypatch):
    q = torch.randn(2, 12, 4)
    tables, key_index = relative_logit_tables_2d(q.view(2, 1, 3, 4, 4), torch.randn(5, 4), torch.randn(7, 4))
    tables = [t.reshape(2, 12, -1) for t in tables]
    fresh = [idx.clone() for idx in key_index]

    def read(*args):
        raise AssertionError("torch.equal: the host waits for the device on CUDA")

    monkeypatch.setattr(torch, "equal", read)
    t_row, t_col, width = row_col_tables_from_index(tables, key_index, 12)
    assert (t_row, t_col, width) == (tables[0], tables[1], 4)
    assert row_col_tables_from_index(tables[1:], key_index[1:], 12) == (None, tables[1], 4)
    with pytest.raises(AssertionError, match="torch.equal"):  # any other index is read
        row_col_tables_from_index(tables, fresh, 12)
    monkeypatch.undo()
    assert row_col_tables_from_index(tables, fresh, 12) == (tables[0], tables[1], 4)


def test_indicators_are_the_one_hot_rows_and_columns():
    ind = grid_indicators(3, 5, ("row", "col"), torch.float16, "cpu")
    pos = torch.arange(15)
    expected = torch.cat([torch.nn.functional.one_hot(pos // 5, 3), torch.nn.functional.one_hot(pos % 5, 5)], -1)
    assert ind.dtype == torch.float16 and torch.equal(ind, expected.half())
    assert grid_indicators(3, 5, ("row", "col"), torch.float16, "cpu") is ind
    assert torch.equal(grid_indicators(3, 5, ("col",), torch.float32, "cpu"), expected[:, 3:].float())


def test_the_least_recently_used_go_first_beyond_the_byte_budget_and_nothing_is_cached_while_exporting(
        monkeypatch):
    monkeypatch.setattr(key_grid, "MAX_CACHED_BYTES", 3 * 2 * 100 * 8)  # three grids of 100 keys
    first = grid_key_index(100, 1, "cpu")
    second = grid_key_index(50, 2, "cpu")
    grid_key_index(25, 4, "cpu")
    assert grid_key_index(100, 1, "cpu") is first  # used again: now the most recent
    grid_key_index(20, 5, "cpu")  # a fourth: the least recently used (50 x 2) goes
    assert grid_of([second[0]]) is None and grid_key_index(50, 2, "cpu")[0] is not second[0]
    assert grid_of([first[0], first[1]]) == (100, 1, ("row", "col"))
    monkeypatch.setattr(key_grid, "is_exporting", lambda: True)
    traced = grid_key_index(104, 1, "cpu")
    assert grid_key_index(104, 1, "cpu")[0] is not traced[0] and grid_of([traced[0]]) is None


#: Attention layers as the CPU tests build them, by family: ``make(impl)`` and the input's shape.
LAYERS = {
    "aa": (lambda impl: AugmentedConv2d(32, 32, 3, dk=16, dv=8, num_heads=4, positional_encoding="relative",
                                        impl=impl), (1, 32, 5, 6)),
    "sasa": (lambda impl: LocalSelfAttention2d(32, 32, kernel_size=5, num_heads=4, impl=impl), (1, 32, 9, 11)),
    "halo": (lambda impl: HaloSelfAttention2d(32, 32, block_size=4, halo_size=1, num_heads=4, impl=impl),
             (1, 32, 9, 11)),
}
ROUTES = [("aa", "fused"), ("aa", "cpp"), ("aa", "materialized"), ("sasa", "fused"), ("sasa", "materialized"),
          ("sasa", "cpp"), ("halo", "fused"), ("halo", "materialized"), ("halo", "bmm"), ("halo", "cpp")]


@pytest.mark.parametrize("family,impl", ROUTES)
@pytest.mark.parametrize("amp", [False, True])
def test_a_layer_call_never_waits_for_the_device(family, impl, amp):
    """Forward + backward of an attention layer, after its first call: no operator that makes the
    host wait (AA's cpp and Triton routes compared the key index with ``torch.equal``, its fused
    route's ``one_hot`` read the index's min and max on a CPU, HaloNet's bmm route asked whether
    every window line was inside the map with ``bool(tensor)``)."""
    make, shape = LAYERS[family]
    layer = make(impl)
    x = torch.randn(*shape, requires_grad=True)

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = layer(x)
        out.float().sum().backward()

    call()
    with _Dispatched() as d:
        call()
    assert not HOST_WAITS & set(d.ops), {op: d.ops[op] for op in HOST_WAITS & set(d.ops)}


@pytest.mark.parametrize("family,impl", ROUTES)
def test_a_map_size_met_first_in_inference_mode_then_trains(family, impl):
    """A constant first made during an evaluation under ``torch.inference_mode`` serves the
    training steps after it at that map size (an inference tensor can never be saved for
    backward: the materialized and fused SASA / HaloNet routes failed so)."""
    make, shape = LAYERS[family]
    layer = make(impl)
    shape = (*shape[:2], shape[2] + 3, shape[3] + 2)  # a map size no other test has used
    with torch.inference_mode():
        layer(torch.randn(*shape))
    layer(torch.randn(*shape, requires_grad=True)).sum().backward()


#: At most this many operators in one forward + backward of a layer (below) on its fused route
#: (fp32, CPU, 20x20 map, 64 channels). Before the per-shape constants were made once
#: (key_grid.cached_constant) and AA's and SASA's tables strided views: AA 186, SASA 298, HaloNet
#: 231. On a GPU whose steps wait on the host, a layer's time is about proportional to it.
FUSED_OPS_BUDGET = {"aa": 120, "sasa": 185, "halo": 185}


@pytest.mark.parametrize("family", sorted(FUSED_OPS_BUDGET))
def test_a_layer_call_dispatches_few_operators(family):
    layer = {
        "aa": lambda: AugmentedConv2d(64, 64, 3, dk=24, dv=16, num_heads=8, positional_encoding="relative",
                                      impl="fused"),
        "sasa": lambda: LocalSelfAttention2d(64, 64, kernel_size=7, num_heads=8, impl="fused"),
        "halo": lambda: HaloSelfAttention2d(64, 64, block_size=8, halo_size=3, num_heads=8, impl="fused"),
    }[family]()
    x = torch.randn(1, 64, 20, 20, requires_grad=True)
    layer(x).sum().backward()
    with _Dispatched() as d:
        layer(x).sum().backward()
    assert sum(d.ops.values()) <= FUSED_OPS_BUDGET[family], (sum(d.ops.values()), d.ops.most_common())
