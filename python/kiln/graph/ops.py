"""Op builders: each adds one node to the graph of its operands (or the entered graph) and returns it.

The builders are kiln's (include/kiln/graph/ops.h); a few of MAX's shape helpers that kiln's IR
expresses as a reshape or a concat are written here over them.
"""
from kiln._kiln.graph.ops import *  # noqa: F401,F403
from kiln._kiln.graph import ops as _ops


def unsqueeze(x, axis):
    """x with a new dim of size 1 at ``axis`` (negative counts from the end of the result)."""
    shape = list(x.shape)
    axis = axis if axis >= 0 else len(shape) + 1 + axis
    return _ops.reshape(x, shape[:axis] + [1] + shape[axis:])


def squeeze(x, axis):
    """x without its size-1 dim ``axis``."""
    shape = list(x.shape)
    axis = axis if axis >= 0 else len(shape) + axis
    if str(shape[axis]) != "1":
        raise ValueError(f"squeeze: dim {axis} of {x.type} is {shape[axis]}, not 1")
    return _ops.reshape(x, shape[:axis] + shape[axis + 1:])


def flatten(x, start_dim=0, end_dim=-1):
    """x with dims start_dim..end_dim (inclusive) merged into one."""
    shape = list(x.shape)
    start = start_dim if start_dim >= 0 else len(shape) + start_dim
    end = end_dim if end_dim >= 0 else len(shape) + end_dim
    merged = shape[start]
    for d in shape[start + 1:end + 1]:
        merged = merged * d
    return _ops.reshape(x, shape[:start] + [merged] + shape[end + 1:])


def stack(values, axis=0):
    """The values (one shape) joined along a new dim ``axis``."""
    return _ops.concat([unsqueeze(v, axis) for v in values], axis)


__all__ = [name for name in dir(_ops) if not name.startswith("_")] + ["flatten", "squeeze", "stack", "unsqueeze"]
