"""kiln's exceptions, with the C++ library's names and messages.

Misuse of an API raises Python's own ``ValueError`` (where MAX raises it); everything else raises
``Error`` (a ``RuntimeError``) or one of its subclasses.
"""
from kiln._kiln.errors import (DTypeError, Error, ExecutionError, ExtensionError, LoadError, ParseError,
                               ShapeError, VerifyError)

for _cls in (DTypeError, Error, ExecutionError, ExtensionError, LoadError, ParseError, ShapeError, VerifyError):
    _cls.__module__ = __name__  # tracebacks say kiln.errors.ShapeError, where users catch it
del _cls

ValueError = ValueError  # the builtin: ``except kiln.errors.ValueError`` and ``except ValueError`` agree

__all__ = ["DTypeError", "Error", "ExecutionError", "ExtensionError", "LoadError", "ParseError", "ShapeError",
           "ValueError", "VerifyError"]
