"""Modules: ``Module`` (MAX's: ``__call__`` is traced into the graph being built), the built-in layers, and
``ModuleV3`` (eager tensors, ``compile``)."""
from kiln import _kiln
from kiln._kiln.graph import Weight
from kiln._kiln.nn import (MLP, AttentionContext, AttentionWithRope, CompiledModuleV3, Embedding, KVCache,
                           LayerNorm, LlamaConfig, Linear, Parameter, RMSNorm, RotaryEmbedding, Tensor,
                           Transformer, TransformerBlock, make_attention_context)
from kiln.nn import functional

_CppModule = _kiln.nn.Module


class Module(_CppModule):
    """A module whose ``__call__`` builds ops into the graph being traced.

    Attributes that are ``Weight`` s or modules are registered under the attribute's name, so weight
    names are the path from the root (``"layers.0.weight"``), as MAX's are; ``state_dict()`` and
    ``load_state_dict()`` work on those names. A weight may be assigned inside ``__call__`` (its
    shape known only then): it is registered on the first trace.
    """

    def __init__(self):
        _CppModule.__init__(self)

    def __setattr__(self, name, value):
        if not name.startswith("_"):
            if isinstance(value, Weight):
                self._register_weight(name, value)
            elif isinstance(value, _CppModule):
                self._register_module(name, value)
        super().__setattr__(name, value)

    def __call__(self, *args):
        raise NotImplementedError(f"{type(self).__name__} does not define __call__")


class LayerList(Module):
    """Modules named "0", "1", ... (weights read "layers.3.mlp.up_proj.weight")."""

    def __init__(self, layers=()):
        super().__init__()
        self._layers = []
        for layer in layers:
            self.append(layer)

    def append(self, layer):
        setattr(self, str(len(self._layers)), layer)
        self._layers.append(layer)

    def __getitem__(self, i):
        return self._layers[i]

    def __len__(self):
        return len(self._layers)

    def __iter__(self):
        return iter(self._layers)

    def __call__(self, x):
        for layer in self._layers:
            x = layer(x)
        return x


Sequential = LayerList

_CppModuleV3 = _kiln.nn.ModuleV3


def _is_array(value):
    return isinstance(value, (_kiln.driver.Tensor, Tensor)) or hasattr(value, "__dlpack__")


class ModuleV3(_CppModuleV3):
    """PyTorch-like modules (MAX's ``max.nn.module_v3``): ``forward`` is ordinary code on
    ``kiln.nn.Tensor``; called on eager tensors it runs at once, and ``compile(*input_types)`` traces
    the same code into a graph whose weights are the module's parameters.

    Array attributes (kiln, numpy or PyTorch) are parameters, named by their path from the root;
    ModuleV3 attributes are children.
    """

    def __init__(self):
        _CppModuleV3.__init__(self)
        object.__setattr__(self, "_kiln_parameters", {})

    def __setattr__(self, name, value):
        if not name.startswith("_"):
            if isinstance(value, _CppModuleV3):
                self._register_module(name, value)
            elif _is_array(value):
                data = value.data if isinstance(value, Tensor) else value
                self._kiln_parameters[name] = self._register_parameter(name, data)
                return
        super().__setattr__(name, value)

    def __getattr__(self, name):
        parameters = self.__dict__.get("_kiln_parameters", {})
        if name in parameters:
            return parameters[name].tensor()  # the data eagerly, the graph weight while staged
        raise AttributeError(f"{type(self).__name__} has no attribute '{name}'")

    def __call__(self, *args):
        return self.forward(*args)

    def forward(self, *args):
        raise NotImplementedError(f"{type(self).__name__} does not define forward")


__all__ = ["MLP", "AttentionContext", "AttentionWithRope", "CompiledModuleV3", "Embedding", "KVCache", "LayerList",
           "LayerNorm", "LlamaConfig", "Linear", "Module", "ModuleV3", "Parameter", "RMSNorm", "RotaryEmbedding",
           "Sequential", "Tensor", "Transformer", "TransformerBlock", "functional", "make_attention_context"]
