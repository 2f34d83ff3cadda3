from . import backbone, meta_arch  # noqa: F401
