"""Building graphs: ``with Graph(name, input_types=[...]) as g``, values with Python operators, ops."""
from kiln._kiln.graph import (BufferType, BufferValue, DeviceKind, DeviceRef, Dim, Graph, Module, TensorType,
                              TensorValue, Value, Weight)
from kiln.graph import ops

# MAX spells each kind of dim as a class; kiln's Dim is one class for all three.
StaticDim = Dim
SymbolicDim = Dim
AlgebraicDim = Dim


def _as_value(weight):
    return TensorValue(weight)


# A Weight is used in ops as the graph value it names: operators and methods go through that value.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__neg__", "__matmul__", "__rmatmul__", "__pow__", "__getitem__", "reshape",
              "transpose", "permute", "cast"):
    setattr(Weight, _name, (lambda name: lambda self, *args: getattr(_as_value(self), name)(*args))(_name))
Weight.T = property(lambda self: _as_value(self).T)
del _name

__all__ = ["AlgebraicDim", "BufferType", "BufferValue", "DeviceKind", "DeviceRef", "Dim", "Graph", "Module",
           "StaticDim", "SymbolicDim", "TensorType", "TensorValue", "Value", "Weight", "ops"]
