"""Sessions and models: ``InferenceSession(devices=[CPU()])``, ``session.load(graph, weights_registry=...)``,
``model.execute(*inputs)``."""
from kiln._kiln.engine import CompiledModel, InferenceSession, Model

__all__ = ["CompiledModel", "InferenceSession", "Model"]
