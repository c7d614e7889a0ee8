"""kiln's exceptions, with the C++ library's names and messages.

Misuse of an API raises Python's own ``ValueError`` (where MAX raises it); everything else raises
``Error`` (a ``RuntimeError``) or one of its subclasses.
"""
from kiln._kiln.errors import (DTypeError, Error, ExecutionError, ExtensionError, LoadError, ParseError,
                               ShapeError, VerifyError)

ValueError = ValueError  # the builtin: ``except kiln.errors.ValueError`` and ``except ValueError`` agree

__all__ = ["DTypeError", "Error", "ExecutionError", "ExtensionError", "LoadError", "ParseError", "ShapeError",
           "ValueError", "VerifyError"]
