"""ModuleV3's ops on ``kiln.nn.Tensor``: they run at once on eager tensors and are traced in ``compile``."""
from kiln._kiln.nn.functional import *  # noqa: F401,F403
from kiln._kiln.nn import functional as _functional

__all__ = [name for name in dir(_functional) if not name.startswith("_")]
