"""Run ``tools/train_net.py`` with the attention deliberately broken, to show that the learning
tests (``tests/engine/test_training.py``) fail when attention is wrong:

  python tests/helpers/broken_attention.py MUTATION --config-file CFG [train_net args and KEY VALUE ...]

MUTATION (applied to every SASA local attention and AA global attention call):

* ``relative_zero``: the relative position embeddings multiplied by 0 (content-only logits);
* ``off_by_one``: keys and values shifted by one row (every window/grid one pixel off, the
  classic mask/index bug);
* ``uniform``: queries multiplied by 0, so every window averages its values (no attention).

``tests/helpers/learning_runs.py`` runs the learning tests' trainings through this with each mutation;
docs/testing.md lists what each broken run reached.
"""
import os
import runpy
import sys

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


def break_attention(mutation: str, patch=setattr):
    """Patch the functional attention entry points the layers' forwards call (module attributes).

    ``patch(module, name, value)``: ``setattr`` (for a whole process, as ``__main__`` does) or
    pytest's ``monkeypatch.setattr`` (undone after the test, ``tests/layers/test_attention_learning.py``).
    """
    if mutation not in MUTATIONS:
        raise SystemExit(f"mutation must be one of {MUTATIONS}; got {mutation!r}")
    import aadet.layers.augmented_conv as aa
    import aadet.layers.local_attention as sasa

    local, relative = sasa.local_self_attention_2d_unchecked, aa.relative_self_attention_2d_unchecked

    def broken_local(q, k, v, rel_h, rel_w, *args, **kwargs):
        return local(*_mutate(mutation, q, k, v, rel_h, rel_w), *args, **kwargs)

    def broken_relative(q, k, v, rel_h, rel_w, *args, **kwargs):
        return relative(*_mutate(mutation, q, k, v, rel_h, rel_w), *args, **kwargs)

    patch(sasa, "local_self_attention_2d_unchecked", broken_local)
    patch(aa, "relative_self_attention_2d_unchecked", broken_relative)


def mark_summary(argv, mutation: str) -> None:
    """Record ``mutation`` as ``"broken_attention"`` in the run's summary (``OUTPUT_DIR`` of the
    command line), so that a broken run can never pass for a correct one in docs/runs."""
    from aadet.utils.run_summary import SUMMARY_FILE, load_summary, write_summary

    if "OUTPUT_DIR" not in argv:
        return
    path = os.path.join(argv[argv.index("OUTPUT_DIR") + 1], SUMMARY_FILE)
    if os.path.isfile(path):
        summary = load_summary(path)
        summary["broken_attention"] = mutation
        write_summary(summary, path)


if __name__ == "__main__":
    mutation = sys.argv.pop(1)
    break_attention(mutation)
    sys.path.insert(0, os.path.join(REPO, "tools"))
    sys.argv[0] = os.path.join(REPO, "tools", "train_net.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        mark_summary(sys.argv, mutation)
