"""``aadet.benchmark.step_profile``: operators sorted into kinds of work, and a real profile whose
time lands in the right kinds (an attention route's autograd Function included)."""
import pytest
import torch
from torch import nn

from types import SimpleNamespace

from aadet.benchmark.step_profile import CATEGORIES, category_of, count_host_ops, profile_call, summarize_events


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


def test_cuda_device_time_is_counted_once():
    """On CUDA a profile lists each kernel twice: as its launching operator's self CUDA time and as
    a device event of its own. The device time is the device events'; the kinds, the operators'."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def row(key, us, count, device_type):
        return SimpleNamespace(key=key, self_device_time_total=us, self_cpu_time_total=5.0, count=count,
                               device_type=device_type)

    events = [row("aten::cudnn_convolution", 3000.0, 4, cpu), row("aten::add_", 1000.0, 10, cpu),
              row("aten::_local_scalar_dense", 0.0, 2, cpu), row("cudaLaunchKernel", 0.0, 20, cpu),
              row("sm90_xmma_fprop_implicit_gemm", 3000.0, 4, cuda), row("elementwise_kernel", 1000.0, 10, cuda),
              row("triton_unclaimed_kernel", 500.0, 2, cuda)]
    p = summarize_events(events, on_device=True)
    assert p["device_ms"] == 4.5 and p["device_events"] == 16  # not 8.5: the kernels once
    assert p["categories"]["conv"] == 3.0 and p["categories"]["other"] == 1.0
    assert p["categories"]["unattributed"] == 0.5  # device time no operator claims
    assert [r["op"] for r in p["top"]] == ["aten::cudnn_convolution", "aten::add_"]
    assert p["host_syncs"] == {"aten::_local_scalar_dense": 2}


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
    assert set(cats) == {name for name, _ in CATEGORIES} | {"other", "unattributed"} and cats["unattributed"] == 0
    assert cats["conv"] > 0 and cats["attention"] > 0  # the route's Function (_CppLocalAttention) by its name
    assert p["device_ms"] == pytest.approx(sum(cats.values()), abs=0.01)
    assert 0 < p["device_ms"] <= p["profiled_ms"]
    assert len(p["top"]) == 5 and [r["ms"] for r in p["top"]] == sorted((r["ms"] for r in p["top"]), reverse=True)
    assert p["host_syncs"] == {"aten::_local_scalar_dense": 1}
    assert 10 < p["host_ops"] < 200  # the call's operators, each once (not their inner calls)
    assert {r["op"] for r in p["top"] if r["category"] == "attention"} <= {
        "_CppLocalAttention", "_CppLocalAttentionBackward"}


def test_host_ops_counts_each_dispatched_operator_once():
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4)

    def call():
        return (lin(x) + 1).sum()  # linear (-> t, addmm inside it), add, sum

    call()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    assert count_host_ops(prof.events()) == 3
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert "aten::addmm" in names and len(names) > 3  # the inner calls the count leaves out
