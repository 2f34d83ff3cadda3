from .checkpoint import AADetCheckpointer, CheckpointMismatchError, atomic_torch_save  # noqa: F401
from .ema import ModelEMA  # noqa: F401
from .hooks import AttentionStatsHook, EMAHook  # noqa: F401
from .schedule import apply_epoch_schedule, epochs_to_iters  # noqa: F401
from .trainer import Trainer  # noqa: F401
from .defaults import get_aadet_cfg, load_config  # noqa: F401
from .predictor import Predictor  # noqa: F401
