"""Op builders: each adds one node to the graph of its operands (or the entered graph) and returns it."""
from kiln._kiln.graph.ops import *  # noqa: F401,F403
from kiln._kiln.graph import ops as _ops

__all__ = [name for name in dir(_ops) if not name.startswith("_")]
