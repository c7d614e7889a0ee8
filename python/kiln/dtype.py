"""Element types with MAX's names: DType.float32, DType.bfloat16, DType.int64, DType.bool, ..."""
from kiln._kiln.dtype import DType

__all__ = ["DType"]
