"""Graphs from Python as MAX builds them: DType, Dim algebra, Graph as a context manager, values with
Python operators, Weight, ops; results checked against numpy."""
import numpy as np
import pytest

from kiln import errors
from kiln.dtype import DType
from kiln.graph import BufferType, DeviceRef, Dim, Graph, TensorType, Weight, ops


def test_dtype_has_max_names_and_numpy_round_trip():
    assert DType.float32.size_in_bytes == 4 and DType.bfloat16.size_in_bytes == 2
    assert DType.float32.to_numpy() == np.float32
    assert DType.from_numpy(np.int64) == DType.int64
    assert DType.from_numpy(np.dtype("bool")) == DType.bool
    with pytest.raises(ValueError, match="bfloat16 has no numpy dtype"):
        DType.bfloat16.to_numpy()


def test_dims_are_static_symbolic_or_algebraic_and_compare_canonically():
    seq = Dim("seq")
    assert Dim(4).is_static and int(Dim(4)) == 4
    assert seq.is_symbolic and seq.name == "seq"
    assert (seq + 1) - 1 == seq           # canonical form
    assert str(seq * 2 + 1) in ("2 * seq + 1", "1 + 2 * seq")
    assert (seq + 1).evaluate({"seq": 5}) == 6
    assert ("n" * Dim(2)) // 2 == Dim("n")
    with pytest.raises(ValueError):
        Dim(-1)


def test_graph_context_manager_operators_and_weights_match_numpy(session):
    x_type = TensorType(DType.float32, ["batch", 4], DeviceRef.CPU())
    with Graph("mlp", input_types=[x_type]) as g:
        x = g.inputs[0]
        w = Weight("w", DType.float32, [4, 3], DeviceRef.CPU())
        b = Weight("b", DType.float32, [3], DeviceRef.CPU())
        h = x @ w + b                      # a Weight is used as the value it names
        y = ops.relu(h) * 2.0 - 1 / (1 + ops.exp(-h))
        g.output(y, ops.softmax(h, axis=-1), h.T, h[0:2, 1:])
    assert [str(d) for d in g.inputs[0].shape] == ["batch", "4"]

    rng = np.random.default_rng(0)
    w_np = rng.standard_normal((4, 3), dtype=np.float32)
    b_np = rng.standard_normal(3, dtype=np.float32)
    model = session.load(g, weights_registry={"w": w_np, "b": b_np})
    for batch in (2, 5):                   # one compile, any batch
        x_np = rng.standard_normal((batch, 4), dtype=np.float32)
        y, soft, ht, sl = model.execute(x_np)
        h_np = x_np @ w_np + b_np
        np.testing.assert_allclose(np.from_dlpack(y), np.maximum(h_np, 0) * 2 - 1 / (1 + np.exp(-h_np)), rtol=1e-5, atol=1e-6)
        e = np.exp(h_np - h_np.max(-1, keepdims=True))
        np.testing.assert_allclose(np.asarray(soft), e / e.sum(-1, keepdims=True), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(ht), h_np.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sl), h_np[0:2, 1:], rtol=1e-5, atol=1e-6)


def test_forward_argument_traces_the_graph_and_int_index_drops_the_axis(session):
    g = Graph("sum_rows", forward=lambda x: ops.sum(x, axis=1)[:, 0] + ops.constant(np.float32(10), DType.float32),
              input_types=[TensorType(DType.float32, [2, 3])])
    out = session.load(g).execute(np.array([[1, 2, 3], [4, 5, 6]], np.float32))[0]
    np.testing.assert_array_equal(np.asarray(out), [16, 25])


def test_constants_ranges_and_casts(session):
    with Graph("consts", input_types=[]) as g:
        c = ops.constant(np.arange(6, dtype=np.int32).reshape(2, 3), DType.int32)
        r = ops.range(0, 6, 2, dtype=DType.int64)
        g.output(ops.cast(c, DType.float32) / 2, r)
    half, r = session.load(g).execute()
    np.testing.assert_array_equal(np.asarray(half), np.arange(6).reshape(2, 3) / 2)
    np.testing.assert_array_equal(np.asarray(r), [0, 2, 4])


def test_buffers_are_written_in_place_through_slices(session):
    with Graph("store", input_types=[BufferType(DType.float32, [4]), TensorType(DType.float32, [2])]) as g:
        buf, x = g.inputs
        buf[1:3] = x * 10
        g.output(buf[0:3])
    cache = np.zeros(4, np.float32)
    head = session.load(g).execute(cache, np.array([1, 2], np.float32))[0]
    np.testing.assert_array_equal(cache, [0, 10, 20, 0])   # the numpy array itself was the buffer
    np.testing.assert_array_equal(np.asarray(head), [0, 10, 20])


def test_op_errors_are_kiln_exception_classes_with_kiln_messages():
    with Graph("bad", input_types=[TensorType(DType.float32, [2, 64]), TensorType(DType.float32, [128, 10])]) as g:
        a, b = g.inputs
        with pytest.raises(errors.ShapeError, match="matmul: lhs inner dim 64 does not match rhs dim 0 of 128") as e:
            ops.matmul(a, b)
        assert isinstance(e.value, errors.Error) and isinstance(e.value, RuntimeError)
        with pytest.raises(ValueError, match="axis 5 out of range for rank 2"):
            ops.softmax(a, axis=5)
    with pytest.raises(ValueError):
        ops.constant(1.0, DType.float32)  # no graph entered: MAX's ValueError too


def test_shape_helpers_match_numpy(session):
    with Graph("shapes", input_types=[TensorType(DType.float32, ["n", 2, 3])]) as g:
        x = g.inputs[0]
        g.output(ops.flatten(x, 1), ops.squeeze(ops.unsqueeze(x, -1), -1), ops.stack([x, x * 2], axis=1))
    a = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    flat, same, stacked = session.load(g).execute(a)
    np.testing.assert_array_equal(np.asarray(flat), a.reshape(4, 6))
    np.testing.assert_array_equal(np.asarray(same), a)
    np.testing.assert_array_equal(np.asarray(stacked), np.stack([a, a * 2], axis=1))
    with Graph("bad_squeeze", input_types=[TensorType(DType.float32, [2])]) as g:
        with pytest.raises(ValueError, match="squeeze: dim 0 of f32\\[2\\] is 2, not 1"):
            ops.squeeze(g.inputs[0], 0)


def test_a_value_keeps_its_graph_alive():
    import gc
    import weakref

    def build():
        with Graph("kept", input_types=[TensorType(DType.float32, ["n", 2])]) as g:
            y = ops.relu(g.inputs[0]) * 2 + ops.constant(1.0, DType.float32)
        return y, weakref.ref(g)

    y, graph = build()
    gc.collect()
    assert graph() is not None                       # the value holds it ...
    assert [str(d) for d in y.shape] == ["n", "2"]   # ... so using the value is safe
    del y
    gc.collect()
    assert graph() is None                           # and lets it go with the last value
