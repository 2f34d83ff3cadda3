"""Run ``tools/train_net.py`` with the attention deliberately broken, to show that the learning
tests (``tests/engine/test_training.py``) fail when attention is wrong:

  python tests/helpers/broken_attention.py MUTATION --config-file CFG [train_net args and KEY VALUE ...]

MUTATION (applied to every SASA local attention, HaloNet blocked attention, AA global attention and
CCNet criss-cross attention call, and to the attention of SASA's spatially-aware stem):

* ``relative_zero``: the relative position embeddings multiplied by 0 (content-only logits; CCNet
  has none, so nothing changes there);
* ``off_by_one``: keys and values shifted by one row (every window/grid one pixel off, the
  classic mask/index bug);
* ``uniform``: queries multiplied by 0, so every window averages its values (no attention).

``tests/helpers/learning_runs.py`` runs the learning tests' trainings through this with each mutation;
docs/testing.md lists what each broken run reached.
"""
import os
import runpy
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script too
MUTATIONS = ("relative_zero", "off_by_one", "uniform")


def _mutate(mutation, q, k, v, rel_h, rel_w):
    if mutation == "relative_zero" and rel_h is not None:
        rel_h, rel_w = rel_h * 0, rel_w * 0
    elif mutation == "off_by_one":
        k, v = k.roll(1, dims=2), v.roll(1, dims=2)  # [B, Nh, H, W, d]: one row down
    elif mutation == "uniform":
        q = q * 0
    return q, k, v, rel_h, rel_w


def _broken_stem(mutation: str, patch) -> None:
    """The spatially-aware attention stem with ``mutation``: all of its routes (factorized,
    projected and the C++ kernel's, the same function) replaced by the projected one computed with
    the mutation (for the kernel's, which works on maps, through the block layout).

    ``off_by_one`` takes the keys and values from the input one row down (the queries from the
    input itself), as the SASA mutation rolls the projected keys and values."""
    import aadet.layers.attention_stem as stem_module

    stem_cls = stem_module.SpatiallyAwareAttentionStem
    forward = stem_cls.forward

    def broken_forward(self, x):
        self._broken_kv_input = x.roll(1, dims=2) if mutation == "off_by_one" else x
        try:
            return forward(self, x)
        finally:
            del self._broken_kv_input

    def broken_attend(self, xb, mask):
        n, p, _ = xb.shape
        xkv = stem_module.map_to_blocks(self._broken_kv_input.to(xb.dtype), self.block_size)
        wq, wk, w_v = self._head_weights(xb.dtype)
        q, _ = self._project_qk(xb, wq, wk)
        _, k = self._project_qk(xkv, wq, wk)
        v = self._block_heads(torch.einsum("npi,poi->npo", xkv, w_v))
        q, k, v, rel_h, rel_w = _mutate(mutation if mutation != "off_by_one" else None,
                                        q, k, v, self.rel_h, self.rel_w)
        out = stem_module.block_attention_unchecked(q, k, v, rel_h, rel_w, self.block_size, mask)
        return out.transpose(1, 2).reshape(n, p, self.out_channels)

    def broken_attend_map(self, x, factorized=None, pooled=False):
        # the "cpp" route: [B, in, H, W] -> [B, out, H, W], or pooled: after norm, pooling and ReLU
        bsz, _, h, w = x.shape
        b = self.block_size
        mask = stem_module.block_padding_mask((h, w), b, x.device)
        if mask is not None:
            mask = mask.repeat(bsz, 1, 1, 1)
        out = stem_module.blocks_to_map(broken_attend(self, stem_module.map_to_blocks(x, b), mask), bsz, (h, w), b)
        return self._norm_relu_pool(out) if pooled else out

    patch(stem_cls, "forward", broken_forward)
    patch(stem_cls, "_attend_factorized", broken_attend)
    patch(stem_cls, "_attend_projected", broken_attend)
    patch(stem_cls, "_attend_cpp", broken_attend_map)


def break_attention(mutation: str, patch=setattr):
    """Patch the functional attention entry points the layers call (module attributes), and the
    attention stem's routes (:func:`_broken_stem`).

    ``patch(module, name, value)``: ``setattr`` (for a whole process, as ``__main__`` does) or
    pytest's ``monkeypatch.setattr`` (undone after the test, ``tests/layers/test_attention_learning.py``).
    """
    if mutation not in MUTATIONS:
        raise SystemExit(f"mutation must be one of {MUTATIONS}; got {mutation!r}")
    import aadet.layers.augmented_conv as aa
    import aadet.layers.criss_cross as ccnet
    import aadet.layers.halo_attention as halo
    import aadet.layers.local_attention as sasa

    local, relative = sasa.local_self_attention_2d_unchecked, aa.relative_self_attention_2d_unchecked
    blocked = halo.halo_attention_2d_unchecked
    criss_cross = ccnet.criss_cross_attention_2d_unchecked

    def broken_local(q, k, v, rel_h, rel_w, *args, **kwargs):
        return local(*_mutate(mutation, q, k, v, rel_h, rel_w), *args, **kwargs)

    def broken_relative(q, k, v, rel_h, rel_w, *args, **kwargs):
        return relative(*_mutate(mutation, q, k, v, rel_h, rel_w), *args, **kwargs)

    def broken_blocked(q, k, v, rel_h, rel_w, *args, **kwargs):
        return blocked(*_mutate(mutation, q, k, v, rel_h, rel_w), *args, **kwargs)

    def broken_criss_cross(q, k, v, *args, **kwargs):
        q, k, v, _, _ = _mutate(mutation, q, k, v, None, None)
        return criss_cross(q, k, v, *args, **kwargs)

    patch(sasa, "local_self_attention_2d_unchecked", broken_local)
    patch(halo, "halo_attention_2d_unchecked", broken_blocked)
    patch(aa, "relative_self_attention_2d_unchecked", broken_relative)
    patch(ccnet, "criss_cross_attention_2d_unchecked", broken_criss_cross)
    _broken_stem(mutation, patch)


def mark_summary(argv, mutation: str) -> None:
    """Record ``mutation`` as ``"broken_attention"`` in the run's summary (``OUTPUT_DIR`` of the
    command line), so that a broken run can never pass for a correct one in docs/runs."""
    from aadet.engine.run_summary import SUMMARY_FILE, load_summary, write_summary

    if "OUTPUT_DIR" not in argv:
        return
    path = os.path.join(argv[argv.index("OUTPUT_DIR") + 1], SUMMARY_FILE)
    if os.path.isfile(path):
        summary = load_summary(path)
        summary["broken_attention"] = mutation
        write_summary(summary, path)


if __name__ == "__main__":
    mutation = sys.argv.pop(1)
    break_attention(mutation)  # aadet_dev: on PYTHONPATH (learning_runs.environment())
    sys.argv[0] = os.path.join(REPO, "tools", "train_net.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        mark_summary(sys.argv, mutation)
