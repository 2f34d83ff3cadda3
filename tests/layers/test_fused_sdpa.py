"""``backends/sdpa.py``'s one SDPA call of the fused routes, in float64 on CPU: what reaches SDPA
is 4-D, of widths a multiple of 8 with v as wide as q, and never more than ``max_extent`` rows of
N a call; chunked, padded and 4-D, it equals the plain formula."""
import pytest
import torch
import torch.nn.functional as F

from aadet.layers.functional.backends.sdpa import WIDTH_MULTIPLE, fused_sdpa

D = torch.float64


def _plain(q, k, v, mask=None):
    logits = q @ k.transpose(-1, -2)
    if mask is not None:
        logits = logits + mask
    return torch.softmax(logits, dim=-1) @ v


@pytest.fixture()
def calls(monkeypatch):
    """Every call that reaches SDPA: its q, k, v and mask shapes."""
    seen, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape, k.shape, v.shape, None if attn_mask is None else attn_mask.shape))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("n,max_extent", [(7, 65535), (7, 3), (6, 2), (1, 1)])
def test_3d_rows_are_chunked_padded_and_exact(calls, n, max_extent):
    """The AA / SASA-blocked layout ``[N, L, E]`` with an odd width and a narrower v."""
    torch.manual_seed(0)
    q, k, v = torch.randn(n, 5, 13, dtype=D), torch.randn(n, 9, 13, dtype=D), torch.randn(n, 9, 6, dtype=D)
    out = fused_sdpa(q, k, v, max_extent=max_extent)
    assert out.shape == (n, 5, 6)
    torch.testing.assert_close(out, _plain(q, k, v), rtol=1e-12, atol=1e-12)
    assert len(calls) == -(-n // max_extent)
    for qs, ks, vs, _ in calls:
        assert len(qs) == 4 and qs[0] == 1 and qs[1] <= max_extent  # N as heads, at most max_extent
        assert qs[-1] == ks[-1] == vs[-1] == 16 and qs[-1] % WIDTH_MULTIPLE == 0


def test_4d_with_a_broadcast_mask_is_chunked_over_n(calls):
    """HaloNet's layout ``[N, blocks, Pq, d]`` with a bias broadcast over N (``[blocks, 1, L]``) and
    one of N's own (``[N, blocks, Pq, L]``)."""
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 3, 4, 6, dtype=D), torch.randn(5, 3, 7, 6, dtype=D), torch.randn(5, 3, 7, 6, dtype=D)
    shared = torch.randn(3, 1, 7, dtype=D).masked_fill(torch.rand(3, 1, 7) < 0.3, float("-inf"))
    shared[..., 0] = 0.0  # every row keeps a key
    own = torch.randn(5, 3, 4, 7, dtype=D)
    for mask in (shared, own, own + shared):
        calls.clear()
        out = fused_sdpa(q, k, v, mask, max_extent=3)
        torch.testing.assert_close(out, _plain(q, k, v, mask), rtol=1e-12, atol=1e-12)
        assert [c[0][0] for c in calls] == [3, 2]


def test_too_many_heads_in_a_4d_call_is_an_error_not_a_wrong_result():
    q = torch.randn(1, 4, 2, 8, dtype=D)
    with pytest.raises(ValueError, match="4 heads in one call; at most 3"):
        fused_sdpa(q, q, q, max_extent=3)


def test_the_fused_routes_call_sdpa_through_it(calls):
    """AA's fused route and HaloNet's reach SDPA 4-D with aligned widths (a 3-D call would run the
    math kernel, which stores the attention matrix)."""
    from aadet.layers.functional import halo_attention_2d, relative_self_attention_2d

    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 6, 3, dtype=torch.float32) for _ in range(3))
    rel_h, rel_w = torch.randn(9, 3), torch.randn(11, 3)
    relative_self_attention_2d(q, k, v, rel_h, rel_w, impl="fused")
    assert calls and all(len(c[0]) == 4 and c[0][-1] % WIDTH_MULTIPLE == 0 and c[0][-1] == c[2][-1]
                         for c in calls)
    calls.clear()
    rel = torch.randn(2 * (4 + 1) - 1, 2)
    q4 = torch.randn(1, 2, 8, 8, 4)
    halo_attention_2d(q4, q4, q4, rel, rel, 4, 1, impl="fused")
    assert calls and all(len(c[0]) == 4 and c[0][-1] % WIDTH_MULTIPLE == 0 for c in calls)
