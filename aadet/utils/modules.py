"""Helpers on ``nn.Module`` objects shared by the engine, the analysis and the modeling wrappers."""
from torch import nn

__all__ = ["unwrap_model"]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` / ``DataParallel`` wrapper (the model
    itself otherwise), so that names and state dicts are those of the bare model."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    return model
