"""kiln.engine from Python: compile once and init many times, artifacts, input_metadata, capture and
replay, a custom kernel library loaded by InferenceSession(custom_extensions=...), and the GIL released
while a model runs."""
import os
import threading
import time

import numpy as np
import pytest

from kiln import errors
from kiln.driver import CPU
from kiln.dtype import DType
from kiln.engine import CompiledModel, InferenceSession
from kiln.graph import BufferType, Graph, TensorType, Weight, ops

EXTENSION = os.environ.get("KILN_EXAMPLE_EXTENSION")
NO_ENTRY = os.environ.get("KILN_TEST_EXTENSION_NO_ENTRY")


def affine_graph():
    with Graph("affine", input_types=[TensorType(DType.float32, ["batch", 2])]) as g:
        g.output(g.inputs[0] @ Weight("w", DType.float32, [2, 2]) + 1)
    return g


def test_input_and_output_metadata_are_the_graph_types(session):
    model = session.load(affine_graph(), weights_registry={"w": np.eye(2, dtype=np.float32)})
    (t,) = model.input_metadata
    assert t.dtype == DType.float32 and [str(d) for d in t.shape] == ["batch", "2"]
    assert repr(model.output_metadata[0]) == "f32[batch, 2]"


def test_one_compile_is_initialised_with_two_checkpoints_and_saved(session, tmp_path):
    compiled = session.compile(affine_graph())
    eye = session.init(compiled, weights_registry={"w": np.eye(2, dtype=np.float32)})["affine"]
    twice = session.init(compiled, weights_registry={"w": 2 * np.eye(2, dtype=np.float32)})["affine"]
    x = np.array([[1, 2]], np.float32)
    np.testing.assert_array_equal(np.asarray(eye.execute(x)[0]), [[2, 3]])
    np.testing.assert_array_equal(np.asarray(twice.execute(x)[0]), [[3, 5]])
    compiled.save(str(tmp_path / "affine.kiln"))
    loaded = session.init(CompiledModel.load(str(tmp_path / "affine.kiln")), weights_registry={"w": np.eye(2, dtype=np.float32)})
    np.testing.assert_array_equal(np.asarray(loaded["affine"].execute(x)[0]), [[2, 3]])


def test_init_names_a_missing_weight(session):
    with pytest.raises(ValueError, match="'w'"):
        session.load(affine_graph(), weights_registry={})


def test_capture_then_replay_reruns_the_recorded_launches(session):
    with Graph("static", input_types=[TensorType(DType.float32, [2, 2])]) as g:
        g.output(g.inputs[0] @ Weight("w", DType.float32, [2, 2]) + 1)
    model = session.load(g, weights_registry={"w": np.eye(2, dtype=np.float32)})
    first = model.capture(np.ones((2, 2), np.float32))[0]
    np.testing.assert_array_equal(np.asarray(first), np.full((2, 2), 2))
    again = model.replay(np.full((2, 2), 3, np.float32))[0]
    np.testing.assert_array_equal(np.asarray(again), np.full((2, 2), 4))
    assert again.data_ptr() == model.replay(np.zeros((2, 2), np.float32))[0].data_ptr()  # the same output, overwritten
    with pytest.raises(ValueError, match="graph 'static' has no capture 'never-captured'"):
        model.replay(np.zeros((2, 2), np.float32), key="never-captured")
    with pytest.raises(ValueError):
        model.replay(np.zeros((3, 2), np.float32))   # another shape than the captured one


@pytest.mark.skipif(not EXTENSION, reason="KILN_EXAMPLE_EXTENSION: the example extension library (ctest sets it)")
def test_a_custom_kernel_library_loaded_by_the_session_runs_its_ops():
    session = InferenceSession(devices=[CPU()], custom_extensions=[EXTENSION])
    assert [str(p) for p in session.custom_extensions] == [EXTENSION]
    with Graph("custom", input_types=[TensorType(DType.float32, [3]), TensorType(DType.float32, [3]),
                                      BufferType(DType.float32, [3])]) as g:
        x, y, acc = g.inputs
        (z,) = ops.custom("scale_add", [x, y], [x.type], parameters={"scale": 2.0})
        ops.inplace_custom("accumulate", [acc, z])
        g.output(z)
    acc = np.array([100, 100, 100], np.float32)
    z = session.load(g).execute(np.array([1, 2, 3], np.float32), np.array([10, 20, 30], np.float32), acc)[0]
    np.testing.assert_array_equal(np.asarray(z), [12, 24, 36])      # x * scale + y, by the library's kernel
    np.testing.assert_array_equal(acc, [112, 124, 136])               # its in-place op wrote the numpy buffer


def test_extension_errors_name_the_library():
    with pytest.raises(errors.ExtensionError, match="/tmp/kiln_no_such_dir/libnope.so"):
        InferenceSession(devices=[CPU()], custom_extensions=["/tmp/kiln_no_such_dir/libnope.so"])
    if NO_ENTRY:
        with pytest.raises(errors.ExtensionError, match=os.path.basename(NO_ENTRY)):
            InferenceSession(devices=[CPU()], custom_extensions=[NO_ENTRY])
    with Graph("unknown", input_types=[TensorType(DType.float32, [3])]) as g:
        (z,) = ops.custom("no_such_op", [g.inputs[0]], [g.inputs[0].type])
        g.output(z)
    with pytest.raises(errors.ExtensionError, match="no_such_op"):
        InferenceSession(devices=[CPU()]).compile(g)


def test_execute_releases_the_gil():
    # A model that runs for a while: a chain of 256x256 matmuls.
    with Graph("chain", input_types=[TensorType(DType.float32, [256, 256])]) as g:
        h = g.inputs[0]
        for _ in range(80):
            h = ops.tanh(h @ h)
        g.output(h)
    model = InferenceSession(devices=[CPU()], num_threads=1).load(g)
    x = np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32) * 0.01
    model.execute(x)
    start = time.perf_counter()
    model.execute(x)
    alone = time.perf_counter() - start

    done = threading.Event()
    worker = threading.Thread(target=lambda: (model.execute(x), model.execute(x), done.set()))
    ticks = 0
    worker.start()
    while not done.is_set():                # Python work on this thread while the model runs on the other
        ticks += 1
        time.sleep(0.001)
    worker.join()
    # Each tick takes at least a millisecond; with the GIL held through execute there would be none.
    could_tick = 2 * alone / 0.0012
    assert ticks > 0.25 * could_tick, (ticks, alone)
