"""ModuleV3 from Python: eager tensors whose ops run at once, parameters from array attributes, and
compile(*input_types) tracing the same forward into a model that computes what eager did."""
import numpy as np
import pytest
import torch

from kiln import nn
from kiln.dtype import DType
from kiln.graph import TensorType

F = nn.functional


class Affine(nn.ModuleV3):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = np.arange(n_in * n_out, dtype=np.float32).reshape(n_in, n_out) / 10
        self.bias = torch.ones(n_out)

    def forward(self, x):
        return F.relu(x @ self.weight + self.bias)


class Net(nn.ModuleV3):
    def __init__(self):
        super().__init__()
        self.first = Affine(4, 3)
        self.second = Affine(3, 2)

    def forward(self, x):
        return F.softmax(self.second(self.first(x)) * 0.5)


def reference(net_state, x):
    h = np.maximum(x @ net_state["first.weight"] + net_state["first.bias"], 0)
    h = np.maximum(h @ net_state["second.weight"] + net_state["second.bias"], 0) * 0.5
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_eager_ops_run_at_once():
    x = nn.Tensor(np.array([1, -2, 3], np.float32))
    y = F.relu(x) * 2.0 + 1
    assert y.is_eager
    np.testing.assert_array_equal(y.to_numpy(), [3, 1, 7])
    np.testing.assert_array_equal(np.from_dlpack(F.sum(y)), [11])


def test_parameters_are_named_by_path_and_load_by_name():
    net = Net()
    assert [name for name, _ in net.parameters()] == ["first.weight", "first.bias", "second.weight", "second.bias"]
    state = net.state_dict()
    np.testing.assert_array_equal(state["first.bias"].to_numpy(), [1, 1, 1])
    net.load_state_dict({**{k: v.to_numpy() for k, v in state.items()}, "second.bias": np.full(2, 5, np.float32)})
    np.testing.assert_array_equal(net.state_dict()["second.bias"].to_numpy(), [5, 5])
    with pytest.raises(ValueError, match="second.bias"):
        net.load_state_dict({k: v for k, v in state.items() if k != "second.bias"})


def test_compile_traces_forward_into_a_model_that_matches_eager_and_numpy():
    net = Net()
    x = np.random.default_rng(3).standard_normal((5, 4), dtype=np.float32)
    eager = net(nn.Tensor(x)).to_numpy()
    compiled = net.compile(TensorType(DType.float32, ["batch", 4]))
    out = np.asarray(compiled(x)[0])
    np.testing.assert_allclose(out, eager, rtol=1e-6)
    state = {k: v.to_numpy() for k, v in net.state_dict().items()}
    np.testing.assert_allclose(out, reference(state, x), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(compiled(x[:2])[0]), reference(state, x[:2]), rtol=1e-5)  # symbolic batch
    assert [w.name for w in net.stage(TensorType(DType.float32, [1, 4])).weights] == [
        "first.weight", "first.bias", "second.weight", "second.bias"]
