"""``aadet.benchmark.step_profile``: operators sorted into kinds of work, and a real profile whose
time lands in the right kinds (an attention route's autograd Function included)."""
import pytest
import torch
from torch import nn

from aadet.benchmark.step_profile import CATEGORIES, category_of, profile_call


@pytest.mark.parametrize("op,category", [
    ("aten::_scaled_dot_product_efficient_attention", "attention"),
    ("aten::_efficient_attention_backward", "attention"),
    ("aten::_flash_attention_forward", "attention"),
    ("_TritonLocalAttention", "attention"),
    ("_RowColAttentionBackward", "attention"),
    ("_HaloBmm", "attention"),
    ("aten::cudnn_convolution", "conv"),
    ("aten::convolution_backward", "conv"),
    ("aten::mkldnn_convolution", "conv"),
    ("aten::addmm", "matmul"),
    ("aten::bmm", "matmul"),
    ("aten::native_group_norm_backward", "norm"),
    ("aten::copy_", "copy"),
    ("aten::cat", "copy"),
    ("aten::constant_pad_nd", "copy"),
    ("aten::add_", "other"),
    ("aten::_softmax", "other"),
])
def test_operators_fall_into_their_kind_of_work(op, category):
    assert category_of(op) == category
    assert category in [name for name, _ in CATEGORIES] + ["other"]


def test_a_profile_of_convs_and_an_attention_route():
    from aadet.layers import LocalSelfAttention2d

    torch.manual_seed(0)
    conv = nn.Conv2d(16, 16, 3, padding=1)
    attention = LocalSelfAttention2d(16, 16, kernel_size=3, num_heads=2, impl="cpp")
    x = torch.randn(2, 16, 24, 24)

    def step():
        loss = (attention(conv(x)) ** 2).sum()
        loss.backward()
        assert float(loss) > 0  # the host reads a value: one _local_scalar_dense

    step()  # warm-up: the C++ kernels load
    p = profile_call(step, "cpu", top=5)
    assert p["device"] == "cpu" and p["device_events"] is None
    cats = p["categories"]
    assert set(cats) == {name for name, _ in CATEGORIES} | {"other"}
    assert cats["conv"] > 0 and cats["attention"] > 0  # the route's Function (_CppLocalAttention) by its name
    assert p["device_ms"] == pytest.approx(sum(cats.values()), abs=0.01)
    assert 0 < p["device_ms"] <= p["profiled_ms"]
    assert len(p["top"]) == 5 and [r["ms"] for r in p["top"]] == sorted((r["ms"] for r in p["top"]), reverse=True)
    assert p["host_syncs"] == {"aten::_local_scalar_dense": 1}
    assert {r["op"] for r in p["top"] if r["category"] == "attention"} <= {
        "_CppLocalAttention", "_CppLocalAttentionBackward"}
