"""kiln: a C++20 inference graph compiler and runtime, with MAX's Python API shape.

MAX code ports by changing the import: ``from max.graph import Graph`` becomes
``from kiln.graph import Graph``, and so on for ``dtype``, ``driver``, ``engine``, ``nn`` and
``pipelines`` (docs/python.md).
"""
from kiln import _kiln
from kiln import driver, dtype, engine, errors, graph, nn, pipelines  # noqa: F401

__version__ = _kiln.__version__
