"""GraphSpec from Python: one test per row of DESIGN.md's contract table, with Python modules (and
ModuleV3s), as tests/pipelines/test_graph_spec*.cpp pins them in C++. The messages are kiln's own:
the spec is kiln's GraphSpec, so each ValueError is the one C++ raises."""
import os

import numpy as np
import pytest

from kiln import errors, nn
from kiln.driver import CPU
from kiln.dtype import DType
from kiln.engine import InferenceSession
from kiln.graph import BufferType, Module as CompileUnit, TensorType, Weight, ops
from kiln.pipelines import GraphSpec, compile_graph_specs


def vec(*values):
    return np.array(values, np.float32)


class ScaleShift(nn.Module):
    """y = x * scale + offset, with a weight of its own."""

    def __init__(self, n=3):
        super().__init__()
        self.scale = Weight("scale", DType.float32, [n])

    def __call__(self, x, offset):
        return x * self.scale + offset


def scale_shift_spec(module, name="scale_shift"):
    return GraphSpec(module=module, name=name,
                     input_types=[TensorType(DType.float32, [3]), TensorType(DType.float32, [3])])


# Row `module`: __call__ runs inside the graph on its inputs; its results are the outputs.
def test_module_call_becomes_the_graph(session):
    m = ScaleShift()
    m.load_state_dict({"scale": vec(1, 2, 3)})
    spec = scale_shift_spec(m)
    g = spec.trace()
    assert len(g.inputs) == 2 and len(g.output_types) == 1
    out = compile_graph_specs(session, [spec])["scale_shift"].execute(vec(1, 1, 1), vec(10, 20, 30))[0]
    np.testing.assert_array_equal(np.asarray(out), [11, 22, 33])


# Row `module`: a plain callable is a module without weights.
def test_a_plain_callable_is_a_module(session):
    spec = GraphSpec(module=lambda x: ops.argmax(x, axis=-1), name="greedy",
                     input_types=[TensorType(DType.float32, ["batch", 3])])
    out = compile_graph_specs(session, [spec])["greedy"].execute(np.array([[1, 7, 3], [9, 0, 1]], np.float32))[0]
    np.testing.assert_array_equal(np.asarray(out), [[1], [0]])


# Row `module`: a null module is a ValueError naming the spec, from each method.
def test_no_module_is_a_value_error_naming_the_spec(session):
    spec = scale_shift_spec(None)
    with pytest.raises(ValueError, match="^GraphSpec 'scale_shift': trace: module is null$"):
        spec.trace()
    with pytest.raises(ValueError, match="^GraphSpec 'scale_shift': weights_registry: module is null$"):
        spec.weights_registry()
    with pytest.raises(ValueError, match="^GraphSpec 'scale_shift': trace: module is null$"):
        compile_graph_specs(session, [spec])


# Row `name`: the graph's name; the result is keyed by it.
def test_name_names_the_graph_and_the_model(session):
    spec = scale_shift_spec(ScaleShift(), "affine")
    assert spec.trace().name == "affine"
    models = compile_graph_specs(session, [spec])
    assert list(models) == ["affine"] and models["affine"].name == "affine"


def test_duplicate_names_in_a_group_name_both(session):
    a, b = scale_shift_spec(ScaleShift(), "model"), scale_shift_spec(ScaleShift(), "model")
    a.group = b.group = "llm"
    with pytest.raises(ValueError, match="two specs are named 'model'") as e:
        compile_graph_specs(session, [a, b])
    assert "'llm' and 'llm'" in str(e.value)


# Row `input_types`, sequence form: one tree per argument.
def test_sequence_input_types_give_one_argument_per_tree():
    g = scale_shift_spec(ScaleShift()).trace()
    assert [repr(t) for t in g.input_types] == ["f32[3]", "f32[3]"]


# Row `input_types`, named-tree form: the module receives the same tree (a dict), leaves in input order.
def test_a_named_tree_reaches_the_module_as_the_same_dict(session):
    received = []

    class TreeModule(nn.Module):
        def __call__(self, tree):
            received.append(tree)
            tokens = tree["tokens"]
            ops.buffer_store(tree["cache"]["k"], tokens)
            ops.buffer_store(tree["cache"]["v"], tokens * 2.0)
            return tokens * 2.0

    types = {"tokens": TensorType(DType.float32, [3]),
             "cache": {"k": BufferType(DType.float32, [3]), "v": BufferType(DType.float32, [3])}}
    spec = GraphSpec(module=TreeModule(), name="tree", input_types=types)
    g = spec.trace()
    tree = received[0]
    assert list(tree) == ["tokens", "cache"] and list(tree["cache"]) == ["k", "v"]
    assert type(tree["cache"]["v"]).__name__ == "BufferValue"
    assert [repr(t) for t in g.input_types] == ["f32[3]", "buffer<f32[3]>", "buffer<f32[3]>"]
    k, v = np.zeros(3, np.float32), np.zeros(3, np.float32)
    out = compile_graph_specs(session, [spec])["tree"].execute(vec(1, 2, 3), k, v)[0]
    np.testing.assert_array_equal(np.asarray(out), [2, 4, 6])
    np.testing.assert_array_equal(k, [1, 2, 3])
    np.testing.assert_array_equal(v, [2, 4, 6])


# Row `weights`: an explicit registry wins over the module's state_dict.
def test_explicit_weights_are_what_the_graph_binds(session):
    m = ScaleShift()
    m.load_state_dict({"scale": vec(1, 1, 1)})
    spec = scale_shift_spec(m)
    spec.weights = {"scale": vec(2, 3, 4)}
    np.testing.assert_array_equal(np.asarray(spec.weights_registry()["scale"]), [2, 3, 4])
    out = compile_graph_specs(session, [spec])["scale_shift"].execute(vec(1, 1, 1), vec(0, 0, 0))[0]
    np.testing.assert_array_equal(np.asarray(out), [2, 3, 4])


# Row `weights`, default: the module's state_dict, named by the attribute path at registration.
def test_default_weights_are_the_state_dict_named_by_attribute_path():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = ScaleShift()

        def __call__(self, x, offset):
            return self.inner(x, offset)

    m = Outer()
    m.load_state_dict({"inner.scale": vec(5, 6, 7)})
    spec = scale_shift_spec(m)
    assert list(spec.weights_registry()) == ["inner.scale"]     # before any trace
    g = spec.trace()
    assert [w.name for w in g.weights] == ["inner.scale"]
    np.testing.assert_array_equal(np.asarray(spec.weights_registry()["inner.scale"]), [5, 6, 7])


class LazyBias(nn.Module):
    """x + bias, where __call__ registers the bias on its first trace, shaped like x."""

    def __call__(self, x):
        if not hasattr(self, "bias"):
            self.bias = Weight("bias", DType.float32, x.shape)
        return x + self.bias


class HoldsLazyBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lazy = LazyBias()

    def __call__(self, x):
        return self.lazy(x)


def lazy_spec(module):
    return GraphSpec(module=module, name="lazy", input_types=[TensorType(DType.float32, [3])])


# Row `weights`, default, read after tracing: a weight __call__ registers is in it (zeros until set).
def test_default_weights_include_a_weight_registered_lazily_in_call(session):
    m = HoldsLazyBias()
    spec = lazy_spec(m)
    assert spec.weights_registry() == {}
    g = spec.trace()
    assert [(w.name, [int(d) for d in w.shape]) for w in g.weights] == [("lazy.bias", [3])]
    np.testing.assert_array_equal(np.asarray(spec.weights_registry()["lazy.bias"]), [0, 0, 0])
    fresh = compile_graph_specs(session, [lazy_spec(HoldsLazyBias())])["lazy"]
    np.testing.assert_array_equal(np.asarray(fresh.execute(vec(1, 2, 3))[0]), [1, 2, 3])
    m.load_state_dict({"lazy.bias": vec(10, 20, 30)})
    out = compile_graph_specs(session, [spec])["lazy"].execute(vec(1, 2, 3))[0]
    np.testing.assert_array_equal(np.asarray(out), [11, 22, 33])
    assert list(m.state_dict()) == ["lazy.bias"]


def test_a_weight_registered_on_every_trace_is_refused_the_second_time():
    class Unguarded(nn.Module):
        def __call__(self, x):
            self.bias = Weight("bias", DType.float32, x.shape)
            return x + self.bias

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Unguarded()

        def __call__(self, x):
            return self.inner(x)

    spec = lazy_spec(Holder())
    spec.trace()
    with pytest.raises(ValueError, match="^register_weight: 'inner.bias' is registered twice$"):
        spec.trace()


# Row `group`: one compile unit, compiled once; a named submodel per spec.
def test_group_compiles_once_with_a_named_submodel_per_spec(session):
    m = ScaleShift()
    m.load_state_dict({"scale": vec(1, -1, 2)})
    model = scale_shift_spec(m, "model")
    sampler = GraphSpec(module=lambda logits: ops.argmax(logits, axis=-1), name="sampler",
                        input_types=[TensorType(DType.float32, ["batch", 3])], group="llm")
    model.group = "llm"
    before = session.compile_count
    models = compile_graph_specs(session, [model, sampler])
    assert session.compile_count - before == 1 and sorted(models) == ["model", "sampler"]
    logits = models["model"].execute(vec(3, 3, 3), vec(0, 10, 0))[0]
    np.testing.assert_array_equal(np.asarray(logits), [3, 7, 6])
    token = models["sampler"].execute(np.asarray(logits).reshape(1, 3))[0]
    np.testing.assert_array_equal(np.asarray(token), [[1]])
    model.group = sampler.group = None
    before = session.compile_count
    compile_graph_specs(session, [model, sampler])
    assert session.compile_count - before == 2


def test_group_registry_conflict_names_both_specs_and_the_weight(session):
    a, b = scale_shift_spec(ScaleShift(), "a"), scale_shift_spec(ScaleShift(), "b")
    a.group = b.group = "g"
    a.weights = {"scale": vec(1, 2, 3)}
    b.weights = {"scale": vec(1, 2, 4)}
    with pytest.raises(ValueError, match="weight 'scale' is bound to different arrays by specs 'a' and 'b'"):
        compile_graph_specs(session, [a, b])
    b.weights = {"scale": vec(1, 2, 3)}  # equal arrays, separately allocated: no conflict
    assert len(compile_graph_specs(session, [a, b])) == 2


# Rows `auto_cast`, `signal_buffer_index` on a Module spec: refused, not ignored.
def test_module_v3_only_options_on_a_module_spec_are_value_errors(session):
    cast = scale_shift_spec(ScaleShift())
    cast.auto_cast = True
    message = r"^GraphSpec 'scale_shift': auto_cast is set, but it applies only to a ModuleV3 graph \(an nn::Module's"
    for call in (cast.trace, cast.weights_registry, lambda: compile_graph_specs(session, [cast])):
        with pytest.raises(ValueError, match=message):
            call()
    signals = scale_shift_spec(ScaleShift())
    signals.signal_buffer_index = 0
    with pytest.raises(ValueError, match=r"signal_buffer_index is set \(0\), but only a ModuleV3 graph gets signal"):
        signals.trace()
    assert session.compile_count == 0


# Row `trace(into)`: the graph is added to the given compile unit.
def test_trace_into_adds_to_the_compile_unit(session):
    unit = CompileUnit()
    a, b = scale_shift_spec(ScaleShift(), "a"), scale_shift_spec(ScaleShift(), "b")
    a.trace(into=unit)
    b.trace(into=unit)
    assert unit.graph_names == ["a", "b"]
    with pytest.raises(ValueError, match="'a'"):
        a.trace(into=unit)
    assert sorted(session.load_all(unit, weights_registry={"scale": vec(1, 1, 1)})) == ["a", "b"]


# Row `custom_extensions`: a missing library is an ExtensionError naming its path.
def test_a_custom_extension_that_does_not_exist_is_an_error_naming_the_path(session):
    spec = scale_shift_spec(ScaleShift())
    spec.custom_extensions = ["/tmp/kiln_no_such_dir/libmissing.so"]
    with pytest.raises(errors.ExtensionError, match="/tmp/kiln_no_such_dir/libmissing.so.*no such file"):
        compile_graph_specs(session, [spec])


# Row `input_types`: fewer trees than __call__ takes is a ValueError in the spec's terms.
def test_wrong_argument_count_is_a_value_error_naming_the_spec(session):
    spec = GraphSpec(module=ScaleShift(), name="scale_shift", input_types=[TensorType(DType.float32, [3])])
    message = (r"^GraphSpec 'scale_shift': forward read past its arguments \(input_types gives it 1 argument tree; "
               r"does it take more\?\)")
    with pytest.raises(ValueError, match=message):
        spec.trace()
    with pytest.raises(ValueError, match=message):
        compile_graph_specs(session, [spec])


# Row `is_device_graph`: the model replays a launch list built at init, and refuses capture.
def test_device_graph_runs_and_refuses_capture(session):
    m = ScaleShift()
    m.load_state_dict({"scale": vec(1, 2, 3)})
    spec = scale_shift_spec(m)
    spec.is_device_graph = True
    models = compile_graph_specs(session, [spec, scale_shift_spec(m, "plain")])
    model = models["scale_shift"]
    assert model.is_device_graph and not models["plain"].is_device_graph
    np.testing.assert_array_equal(np.asarray(model.execute(vec(1, 1, 1), vec(10, 20, 30))[0]), [11, 22, 33])
    np.testing.assert_array_equal(np.asarray(model.execute(vec(2, 0, -1), vec(0, 0, 0))[0]), [2, 0, -3])
    with pytest.raises(ValueError, match="graph 'scale_shift' is a device graph"):
        model.capture(vec(1, 1, 1), vec(0, 0, 0), key="k")


# ---- ModuleV3 rows ---------------------------------------------------------------------------------------

class ScaleShiftV3(nn.ModuleV3):
    """relu(x * scale + shift): scale f32 [3], shift f32 [3]."""

    def __init__(self):
        super().__init__()
        self.scale = vec(1, 2, 3)
        self.shift = vec(-1, 0, 1)

    def forward(self, x):
        return nn.functional.relu(x * self.scale + self.shift)


def v3_spec(module):
    return GraphSpec(module=module, name="scale_shift", input_types=[TensorType(DType.float32, [3])])


def test_v3_forward_is_traced_and_matches_eager(session):
    m = ScaleShiftV3()
    eager = m(nn.Tensor(vec(1, -1, 2)))
    out = compile_graph_specs(session, [v3_spec(m)])["scale_shift"].execute(vec(1, -1, 2))[0]
    np.testing.assert_array_equal(np.asarray(out), eager.to_numpy())
    np.testing.assert_array_equal(np.asarray(out), [0, 0, 7])


def test_v3_takes_input_types_as_a_sequence_only():
    spec = GraphSpec(module=ScaleShiftV3(), name="tree", input_types={"a": TensorType(DType.float32, [3])})
    with pytest.raises(ValueError, match="GraphSpec 'tree': a ModuleV3 graph takes input_types as a sequence"):
        spec.trace()


def test_v3_wrong_argument_count_names_the_graph():
    class Sum(nn.ModuleV3):
        def forward(self, a, b):
            return a + b

    spec = GraphSpec(module=Sum(), name="sum", input_types=[TensorType(DType.float32, [3])])
    with pytest.raises(ValueError, match=r"^ModuleV3::stage 'sum': forward read past its arguments"):
        spec.trace()


def test_v3_weights_default_to_the_modules_own_parameters(session):
    m = ScaleShiftV3()
    registry = v3_spec(m).weights_registry()
    assert sorted(registry) == ["scale", "shift"]
    assert registry["scale"].data_ptr() == dict(m.parameters())["scale"].data_ptr()  # the parameter's memory


def test_v3_group_and_trace_into_are_refused(session):
    spec = v3_spec(ScaleShiftV3())
    spec.group = "llm"
    with pytest.raises(ValueError, match="spec 'scale_shift' is a ModuleV3 graph with group 'llm'"):
        compile_graph_specs(session, [spec])
    with pytest.raises(ValueError, match="GraphSpec 'scale_shift': trace\\(into\\): a ModuleV3 graph compiles on its own"):
        v3_spec(ScaleShiftV3()).trace(into=CompileUnit())


def test_v3_dtype_mismatch_without_auto_cast_names_the_weight_and_both_dtypes(session):
    spec = v3_spec(ScaleShiftV3())
    spec.weights = {"scale": np.zeros(3, np.float64), "shift": vec(0, 0, 0)}
    with pytest.raises(ValueError, match="weight 'scale' has dtype f64 but its parameter is declared f32"):
        compile_graph_specs(session, [spec])


def test_v3_auto_cast_casts_bf16_weights(session):
    spec = v3_spec(ScaleShiftV3())
    import torch
    spec.weights = {"scale": torch.full((3,), 2.0, dtype=torch.bfloat16), "shift": vec(0, 0, 0)}
    spec.auto_cast = True
    out = compile_graph_specs(session, [spec])["scale_shift"].execute(vec(1, 2, 3))[0]
    np.testing.assert_array_equal(np.asarray(out), [2, 4, 6])


def test_v3_signal_buffer_index_out_of_range_is_a_value_error():
    m = ScaleShiftV3()
    m.devices = [CPU(0), CPU(1)]
    spec = v3_spec(m)
    spec.signal_buffer_index = 5
    with pytest.raises(ValueError, match="signal_buffer_index"):
        spec.trace()


# Row `custom_extensions`: the spec's libraries are loaded for its compile; ops.custom resolves there.
@pytest.mark.skipif(not os.environ.get("KILN_EXAMPLE_EXTENSION"), reason="KILN_EXAMPLE_EXTENSION (ctest sets it)")
def test_a_specs_custom_extension_serves_its_custom_ops(session):
    def scale_add(x, y):
        return ops.custom("scale_add", [x, y], [x.type], parameters={"scale": 3.0})[0]

    spec = scale_shift_spec(scale_add, "custom")
    spec.custom_extensions = [os.environ["KILN_EXAMPLE_EXTENSION"]]
    out = compile_graph_specs(session, [spec])["custom"].execute(vec(1, 2, 3), vec(1, 1, 1))[0]
    np.testing.assert_array_equal(np.asarray(out), [4, 7, 10])


def test_an_exception_in_call_reaches_the_caller_unchanged(session):
    class Broken(nn.Module):
        def __call__(self, x, offset):
            raise KeyError("no such layer")

    with pytest.raises(KeyError, match="no such layer"):
        compile_graph_specs(session, [scale_shift_spec(Broken())])
