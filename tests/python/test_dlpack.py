"""Arrays through DLPack with numpy and PyTorch: zero-copy both ways (the same data pointer) and the
lifetimes right (an output outlives its model; a weight outlives the Python name it came from)."""
import gc

import numpy as np
import pytest
import torch

from kiln.driver import CPU, Tensor
from kiln.dtype import DType
from kiln.engine import InferenceSession
from kiln.graph import BufferType, Graph, TensorType, Weight, ops


def scale_graph():
    with Graph("scale", input_types=[TensorType(DType.float32, ["n"])]) as g:
        g.output(g.inputs[0] * Weight("w", DType.float32, [1]))
    return g


def test_numpy_and_torch_arrays_import_without_a_copy():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor.from_dlpack(a)
    assert t.data_ptr() == a.ctypes.data
    assert t.shape == (2, 3) and t.dtype == DType.float32 and t.device == CPU()
    tt = torch.arange(6, dtype=torch.int64)
    k = Tensor.from_dlpack(tt)
    assert k.data_ptr() == tt.data_ptr() and k.dtype == DType.int64
    # A strided view keeps its strides (in elements), still without a copy.
    v = Tensor.from_dlpack(a[:, ::2])
    assert v.data_ptr() == a.ctypes.data and v.strides == (3, 2) and not v.is_contiguous


def test_kiln_tensors_export_to_numpy_and_torch_without_a_copy(session):
    y = session.load(scale_graph(), weights_registry={"w": np.array([2], np.float32)}).execute(
        np.array([1, 2, 3], np.float32))[0]
    as_np = np.from_dlpack(y)
    as_torch = torch.from_dlpack(y)
    assert as_np.ctypes.data == y.data_ptr() == as_torch.data_ptr()
    np.testing.assert_array_equal(as_np, [2, 4, 6])
    assert torch.equal(as_torch, torch.tensor([2.0, 4.0, 6.0]))
    as_torch[0] = 7                       # one memory: numpy sees torch's write
    assert as_np[0] == 7


def test_a_dlpack_1_consumer_gets_the_versioned_capsule():
    t = Tensor.from_dlpack(np.ones(3, np.float32))
    assert "dltensor_versioned" in repr(t.__dlpack__(max_version=(1, 0)))
    assert '"dltensor"' in repr(t.__dlpack__())
    back = Tensor.from_dlpack(t.__dlpack__(max_version=(1, 0)))
    assert back.data_ptr() == t.data_ptr()


def test_an_output_outlives_its_model_and_session():
    session = InferenceSession(devices=[CPU()])
    model = session.load(scale_graph(), weights_registry={"w": np.array([3], np.float32)})
    out = np.from_dlpack(model.execute(np.array([1, 2], np.float32))[0])
    del model, session
    gc.collect()
    np.testing.assert_array_equal(out, [3, 6])


def test_a_weight_outlives_the_python_object_it_came_from(session):
    w = np.array([5], np.float32)
    model = session.load(scale_graph(), weights_registry={"w": w})
    del w
    gc.collect()
    np.testing.assert_array_equal(np.asarray(model.execute(np.array([1, 2], np.float32))[0]), [5, 10])
    t = torch.tensor([4.0])
    model = session.load(scale_graph(), weights_registry={"w": t})
    del t
    gc.collect()
    np.testing.assert_array_equal(np.asarray(model.execute(torch.tensor([1.0, 2.0]))[0]), [4, 8])


def test_torch_buffers_are_updated_in_place(session):
    with Graph("acc", input_types=[BufferType(DType.float32, [3]), TensorType(DType.float32, [3])]) as g:
        buf, x = g.inputs
        ops.buffer_store(buf, ops.buffer_load(buf) + x)
        g.output(x)
    model = session.load(g)
    state = torch.zeros(3)
    for _ in range(3):
        model.execute(state, torch.ones(3))
    assert torch.equal(state, torch.full((3,), 3.0))


def test_a_non_array_is_a_value_error_naming_its_type(session):
    with pytest.raises(ValueError, match="a str is not an array"):
        Tensor.from_dlpack("nope")
    model = session.load(scale_graph(), weights_registry={"w": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match="dtype"):
        model.execute(np.ones(2, np.int32))   # kiln's execute check: the input's dtype


def test_a_read_only_numpy_array_is_taken_without_a_copy(session):
    y = session.load(scale_graph(), weights_registry={"w": np.array([2], np.float32)}).execute(
        np.array([1, 2, 3], np.float32))[0]
    read_only = np.from_dlpack(y)            # numpy 1.x marks DLPack imports read-only ...
    assert not read_only.flags.writeable
    again = Tensor.from_dlpack(read_only)    # ... and will not export them: kiln reads its array interface
    assert again.data_ptr() == y.data_ptr() == read_only.ctypes.data


def test_bfloat16_crosses_to_and_from_torch_without_a_copy():
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    k = Tensor.from_dlpack(t)
    assert k.dtype == DType.bfloat16 and k.data_ptr() == t.data_ptr()
    back = torch.from_dlpack(k)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()
