// kiln.pipelines: GraphSpec (every field, trace, weights_registry) over kiln's own, so its checks and
// ValueError messages are kiln's; compile_graph_specs; the text-generation pipeline and the batching
// engine, whose waits release the GIL and let Ctrl-C cancel the request.
#include <fmt/format.h>

#include <chrono>

#include "bindings.h"

namespace kiln::python {

namespace {

using namespace pybind11::literals;
using pipelines::GenerationEngine;
using pipelines::GraphSpec;

// A GraphSpec as Python holds it: kiln's, plus the Python objects it was given (a Python module must
// outlive the spec, since its __call__ is the trace).
struct PyGraphSpec {
  GraphSpec spec;
  py::object module = py::none();
  py::object input_types = py::none();
};

void set_module(PyGraphSpec& s, py::object module) {
  if (module.is_none())
    s.spec.module = std::shared_ptr<nn::Module>();
  else if (py::isinstance<nn::Module>(module))
    s.spec.module = module.cast<std::shared_ptr<nn::Module>>();
  else if (py::isinstance<nn::ModuleV3>(module))
    s.spec.module = module.cast<std::shared_ptr<nn::ModuleV3>>();
  else if (PyCallable_Check(module.ptr()))
    s.spec.module = module_from_callable(module);
  else
    throw py::type_error("GraphSpec.module: expected a kiln.nn.Module, a kiln.nn.ModuleV3 or a callable");
  s.module = std::move(module);
}

// A list (one tree per argument) or one named tree (a dict: its leaves, in order, are the inputs).
void set_input_types(PyGraphSpec& s, py::object types) {
  if (py::isinstance<py::dict>(types)) {
    s.spec.input_types = type_tree_from_python(types);
  } else {
    std::vector<nn::TypeTree> trees;
    for (py::handle t : types) trees.push_back(type_tree_from_python(t));
    s.spec.input_types = std::move(trees);
  }
  s.input_types = std::move(types);
}

pipelines::EngineOptions engine_options(const py::kwargs& kw) {
  pipelines::EngineOptions o;
  for (auto [key, value] : kw) {
    const std::string name = py::cast<std::string>(key);
    if (name == "max_seq_len")
      o.max_seq_len = value.cast<int64_t>();
    else if (name == "num_threads")
      o.num_threads = value.cast<int>();
    else if (name == "sampler_max_top_k")
      o.sampler_max_top_k = value.cast<int64_t>();
    else if (name == "kv_cache_dtype")
      o.kv_cache_dtype = value.cast<DType>();
    else if (name == "kv_cache_bytes")
      o.kv_cache_bytes = value.cast<int64_t>();
    else if (name == "kv_block_size")
      o.kv_block_size = value.cast<int64_t>();
    else if (name == "enable_prefix_caching")
      o.enable_prefix_caching = value.cast<bool>();
    else if (name == "max_num_seqs")
      o.max_num_seqs = value.cast<int64_t>();
    else if (name == "max_num_batched_tokens")
      o.max_num_batched_tokens = value.cast<int64_t>();
    else
      throw ValueError(fmt::format("engine options: unknown option '{}'", name));
  }
  return o;
}

pipelines::SamplingParams sampling_params(const py::kwargs& kw) {
  pipelines::SamplingParams p;
  py::object view = py::cast(&p, py::return_value_policy::reference);
  for (auto [key, value] : kw) {
    if (!py::hasattr(view, key))
      throw ValueError(fmt::format("sampling: unknown parameter '{}'", py::cast<std::string>(key)));
    py::setattr(view, key, value);
  }
  return p;
}

pipelines::GenerationRequest make_request(const py::object& prompt, pipelines::SamplingParams sampling) {
  pipelines::GenerationRequest r;
  if (py::isinstance<py::str>(prompt))
    r.prompt = prompt.cast<std::string>();
  else
    r.prompt_ids = prompt.cast<std::vector<int64_t>>();
  r.sampling = std::move(sampling);
  return r;
}

// Folds one update into the request's output.
void absorb(pipelines::GenerationOutput& out, const pipelines::RequestUpdate& u) {
  out.id = u.id;
  out.tokens.insert(out.tokens.end(), u.tokens.begin(), u.tokens.end());
  out.text += u.text;
  if (u.finish) out.finish = *u.finish;
  if (!u.error.empty()) out.error = u.error;
  if (u.stop_string) out.stop_string = u.stop_string;
  out.metrics = u.metrics;
}

// Waits for the next update with the GIL released, a short slice at a time; between slices a pending
// Ctrl-C (PyErr_CheckSignals) cancels the request and raises KeyboardInterrupt.
std::optional<pipelines::RequestUpdate> next_update(GenerationEngine& engine,
                                                    pipelines::RequestStream& stream) {
  while (!stream.done()) {
    std::optional<pipelines::RequestUpdate> u;
    {
      py::gil_scoped_release release;
      u = stream.next(std::chrono::milliseconds(50));
    }
    if (u) return u;
    if (PyErr_CheckSignals() != 0) {
      engine.cancel(stream.id());
      throw py::error_already_set();
    }
  }
  return std::nullopt;
}

// Runs requests to the end, together (they share the engine's steps). on_text(index, text) gets each
// piece of text as it comes.
std::vector<pipelines::GenerationOutput> run_requests(GenerationEngine& engine,
                                                      std::vector<pipelines::GenerationRequest> requests,
                                                      const py::object& on_text) {
  std::vector<pipelines::RequestStream> streams;
  {
    py::gil_scoped_release release;
    for (auto& r : requests) streams.push_back(engine.stream(std::move(r)));
  }
  std::vector<pipelines::GenerationOutput> outputs(streams.size());
  try {
    for (size_t i = 0; i < streams.size(); ++i) {
      while (auto u = next_update(engine, streams[i])) {
        absorb(outputs[i], *u);
        if (!on_text.is_none() && !u->text.empty()) on_text(i, u->text);
        if (u->finish) break;
      }
    }
  } catch (...) {
    for (auto& s : streams) engine.cancel(s.id());  // an interrupt or a failing callback stops them all
    throw;
  }
  return outputs;
}

}  // namespace

void bind_pipelines(py::module_& m) {
  py::class_<PyGraphSpec, std::shared_ptr<PyGraphSpec>>(
      m, "GraphSpec", "A graph a pipeline compiles, as the module that traces it.")
      .def(py::init([](py::object module, std::string name, py::object input_types, const py::object& weights,
                       std::optional<std::string> group, std::vector<std::filesystem::path> custom_extensions,
                       bool is_device_graph, bool auto_cast, std::optional<int> signal_buffer_index) {
             auto s = std::make_shared<PyGraphSpec>();
             set_module(*s, std::move(module));
             s->spec.name = std::move(name);
             set_input_types(*s, std::move(input_types));
             if (!weights.is_none()) s->spec.weights = registry_from_python(weights);
             s->spec.group = std::move(group);
             s->spec.custom_extensions = std::move(custom_extensions);
             s->spec.is_device_graph = is_device_graph;
             s->spec.auto_cast = auto_cast;
             s->spec.signal_buffer_index = signal_buffer_index;
             return s;
           }),
           "module"_a, "name"_a, "input_types"_a, "weights"_a = py::none(), "group"_a = py::none(),
           "custom_extensions"_a = std::vector<std::filesystem::path>{}, "is_device_graph"_a = false,
           "auto_cast"_a = false, "signal_buffer_index"_a = py::none())
      .def_property(
          "module", [](const PyGraphSpec& s) { return s.module; }, &set_module)
      .def_property(
          "name", [](const PyGraphSpec& s) { return s.spec.name; },
          [](PyGraphSpec& s, std::string n) { s.spec.name = std::move(n); })
      .def_property(
          "input_types", [](const PyGraphSpec& s) { return s.input_types; }, &set_input_types)
      .def_property(
          "weights",
          [](const PyGraphSpec& s) -> py::object {
            if (!s.spec.weights) return py::none();
            return registry_to_python(*s.spec.weights);
          },
          [](PyGraphSpec& s, const py::object& w) {
            if (w.is_none())
              s.spec.weights.reset();
            else
              s.spec.weights = registry_from_python(w);
          })
      .def_property(
          "group", [](const PyGraphSpec& s) { return s.spec.group; },
          [](PyGraphSpec& s, std::optional<std::string> g) { s.spec.group = std::move(g); })
      .def_property(
          "custom_extensions", [](const PyGraphSpec& s) { return s.spec.custom_extensions; },
          [](PyGraphSpec& s, std::vector<std::filesystem::path> p) {
            s.spec.custom_extensions = std::move(p);
          })
      .def_property(
          "is_device_graph", [](const PyGraphSpec& s) { return s.spec.is_device_graph; },
          [](PyGraphSpec& s, bool v) { s.spec.is_device_graph = v; })
      .def_property(
          "auto_cast", [](const PyGraphSpec& s) { return s.spec.auto_cast; },
          [](PyGraphSpec& s, bool v) { s.spec.auto_cast = v; })
      .def_property(
          "signal_buffer_index", [](const PyGraphSpec& s) { return s.spec.signal_buffer_index; },
          [](PyGraphSpec& s, std::optional<int> i) { s.spec.signal_buffer_index = i; })
      .def(
          "trace",
          [](const PyGraphSpec& s, const std::optional<ModuleHandle>& into) {
            py::object unit = into ? py::cast(*into) : py::none();
            if (into) note_graph_owner(into->get(), unit);  // values made while tracing keep it alive
            graph::Graph g = s.spec.trace(into ? into->get() : nullptr);
            return graph_to_python(std::make_shared<GraphHandle>(std::move(g), unit));
          },
          "into"_a = py::none())
      .def("weights_registry",
           [](const PyGraphSpec& s) { return registry_to_python(s.spec.weights_registry()); });

  m.def(
      "compile_graph_specs",
      [](engine::InferenceSession& session, const std::vector<std::shared_ptr<PyGraphSpec>>& specs) {
        std::vector<GraphSpec> plain;
        for (const auto& s : specs) plain.push_back(s->spec);
        std::map<std::string, engine::Model> models;
        {
          py::gil_scoped_release release;  // a Python module's trace takes it back
          models = pipelines::compile_graph_specs(session, plain);
        }
        return models_to_python(std::move(models));
      },
      "session"_a, "specs"_a);

  // ---- generation ---------------------------------------------------------------------------------------
  py::class_<pipelines::SamplingParams>(m, "SamplingParams")
      .def(py::init([](const py::kwargs& kw) { return sampling_params(kw); }))
      .def_readwrite("max_new_tokens", &pipelines::SamplingParams::max_new_tokens)
      .def_readwrite("temperature", &pipelines::SamplingParams::temperature)
      .def_readwrite("top_k", &pipelines::SamplingParams::top_k)
      .def_readwrite("top_p", &pipelines::SamplingParams::top_p)
      .def_readwrite("min_p", &pipelines::SamplingParams::min_p)
      .def_readwrite("repetition_penalty", &pipelines::SamplingParams::repetition_penalty)
      .def_readwrite("frequency_penalty", &pipelines::SamplingParams::frequency_penalty)
      .def_readwrite("presence_penalty", &pipelines::SamplingParams::presence_penalty)
      .def_readwrite("seed", &pipelines::SamplingParams::seed)
      .def_readwrite("stop", &pipelines::SamplingParams::stop)
      .def_readwrite("stop_token_ids", &pipelines::SamplingParams::stop_token_ids)
      .def_readwrite("ignore_eos", &pipelines::SamplingParams::ignore_eos);

  py::class_<pipelines::GenerationOutput>(m, "GenerationOutput")
      .def_readonly("id", &pipelines::GenerationOutput::id)
      .def_property_readonly("token_ids",
                             [](const pipelines::GenerationOutput& o) {
                               std::vector<int64_t> ids;
                               for (const auto& t : o.tokens) ids.push_back(t.id);
                               return ids;
                             })
      .def_readonly("text", &pipelines::GenerationOutput::text)
      .def_property_readonly("finish_reason",
                             [](const pipelines::GenerationOutput& o) {
                               return std::string(pipelines::finish_reason_name(o.finish));
                             })
      .def_readonly("error", &pipelines::GenerationOutput::error)
      .def_readonly("stop_string", &pipelines::GenerationOutput::stop_string)
      .def_property_readonly("prompt_tokens",
                             [](const pipelines::GenerationOutput& o) { return o.metrics.prompt_tokens; })
      .def_property_readonly("cached_prompt_tokens", [](const pipelines::GenerationOutput& o) {
        return o.metrics.cached_prompt_tokens;
      });

  py::class_<pipelines::EngineStats>(m, "EngineStats")
      .def_readonly("waiting", &pipelines::EngineStats::waiting)
      .def_readonly("running", &pipelines::EngineStats::running)
      .def_readonly("steps", &pipelines::EngineStats::steps)
      .def_readonly("prompt_tokens", &pipelines::EngineStats::prompt_tokens)
      .def_readonly("cached_prompt_tokens", &pipelines::EngineStats::cached_prompt_tokens)
      .def_readonly("generated_tokens", &pipelines::EngineStats::generated_tokens)
      .def_readonly("kv_blocks_total", &pipelines::EngineStats::kv_blocks_total);

  // The batching engine: many requests at once (docs/batching.md).
  py::class_<GenerationEngine, std::shared_ptr<GenerationEngine>>(m, "GenerationEngine")
      .def(py::init([](const std::filesystem::path& model_path, const py::kwargs& options) {
             pipelines::EngineOptions o = engine_options(options);
             py::gil_scoped_release release;
             return std::shared_ptr<GenerationEngine>(GenerationEngine::from_dir(model_path, o));
           }),
           "model_path"_a)
      .def(
          "generate",
          [](GenerationEngine& engine, const py::object& prompts, const py::object& on_text,
             const py::kwargs& sampling) -> py::object {
            // One prompt is text or a list of ids; anything else is a list of prompts.
            auto is_ids = [](const py::object& p) {
              if (!py::isinstance<py::list>(p) && !py::isinstance<py::tuple>(p)) return false;
              py::sequence seq = p;
              return seq.size() > 0 && py::isinstance<py::int_>(seq[0]);
            };
            const bool one = py::isinstance<py::str>(prompts) || is_ids(prompts);
            std::vector<pipelines::GenerationRequest> requests;
            pipelines::SamplingParams params = sampling_params(sampling);
            if (one)
              requests.push_back(make_request(prompts, params));
            else
              for (py::handle p : prompts)
                requests.push_back(make_request(py::reinterpret_borrow<py::object>(p), params));
            auto outputs = run_requests(engine, std::move(requests), on_text);
            if (one) return py::cast(outputs.at(0));
            return py::cast(outputs);
          },
          "prompts"_a, "on_text"_a = py::none(),
          "One prompt (text or ids) or a list of them, run together; sampling parameters as keywords.")
      .def("stats", &GenerationEngine::stats)
      .def_property_readonly("max_seq_len", &GenerationEngine::max_seq_len)
      .def_property_readonly("eos_token_ids", &GenerationEngine::eos_token_ids)
      .def_property_readonly("compile_count", &GenerationEngine::compile_count)
      .def(
          "encode",
          [](const GenerationEngine& e, const std::string& text) {
            if (!e.tokenizer()) throw ValueError("encode: the engine has no tokenizer");
            return e.tokenizer()->encode(text);
          },
          "text"_a)
      .def(
          "decode",
          [](const GenerationEngine& e, const std::vector<int64_t>& ids) {
            if (!e.tokenizer()) throw ValueError("decode: the engine has no tokenizer");
            return e.tokenizer()->decode(ids);
          },
          "ids"_a);

  py::class_<pipelines::TextGenerationPipeline>(m, "TextGenerationPipeline")
      .def(py::init([](const std::filesystem::path& model_path, const py::kwargs& options) {
             pipelines::EngineOptions o = engine_options(options);
             py::gil_scoped_release release;
             return pipelines::TextGenerationPipeline::from_dir(model_path, o);
           }),
           "model_path"_a)
      .def(
          "generate",
          [](pipelines::TextGenerationPipeline& pipe, const std::string& prompt, int64_t max_new_tokens,
             double temperature, int64_t top_k, double top_p, uint64_t seed, bool stop_at_eos,
             const py::object& on_text) {
            pipelines::GenerationOptions options{max_new_tokens, temperature, top_k,
                                                 top_p,          seed,        stop_at_eos};
            pipelines::check_generation_options(options);
            pipelines::SamplingParams p;
            p.max_new_tokens = max_new_tokens;
            p.temperature = temperature;
            p.top_k = top_k;
            p.top_p = top_p;
            p.seed = seed;
            p.ignore_eos = !stop_at_eos;
            py::object each = on_text.is_none()
                                  ? py::object(py::none())
                                  : py::cpp_function([on_text](size_t, const std::string& t) { on_text(t); });
            std::vector<pipelines::GenerationRequest> requests;
            requests.push_back(make_request(py::str(prompt), p));
            pipelines::GenerationOutput out = run_requests(pipe.engine(), std::move(requests), each).at(0);
            if (out.finish == pipelines::FinishReason::error) throw ExecutionError(out.error);
            return out;
          },
          "prompt"_a, "max_new_tokens"_a = 128, "temperature"_a = 1.0, "top_k"_a = 0, "top_p"_a = 1.0,
          "seed"_a = 0, "stop_at_eos"_a = true, "on_text"_a = py::none())
      .def_property_readonly(
          "engine",
          [](const pipelines::TextGenerationPipeline& p) {
            // The pipeline owns its engine; the Python engine object borrows it for the pipeline's life.
            return &p.engine();
          },
          py::return_value_policy::reference_internal)
      .def_property_readonly("max_seq_len", &pipelines::TextGenerationPipeline::max_seq_len)
      .def_property_readonly("compile_count", &pipelines::TextGenerationPipeline::compile_count);
}

}  // namespace kiln::python
