// The `kiln` command.
//   kiln check FILE [--optimized]           parse and verify a graph text file, print it back
//   kiln run FILE [--dim name=N ...] [--seed S] [--graph NAME]
//                                           compile it, bind seeded random weights and inputs, run it,
//                                           print the outputs
//   kiln version
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <kiln/kiln.h>

using namespace kiln;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw LoadError(fmt::format("cannot open '{}'", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Seeded values for any dtype: floats ~ N(0, 1), integers in [0, 10), booleans fair coin.
Tensor random_tensor(DType dtype, const std::vector<int64_t>& shape, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(dtype, shape);
  visit_dtype(dtype, [&]<class T>() {
    T* data = static_cast<T*>(t.data());
    std::normal_distribution<float> normal;
    std::uniform_int_distribution<int> small(0, 9);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if constexpr (std::is_same_v<T, bool>)
        data[i] = small(rng) < 5;
      else if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>)
        data[i] = T(normal(rng));
      else if constexpr (std::is_floating_point_v<T>)
        data[i] = static_cast<T>(normal(rng));
      else
        data[i] = static_cast<T>(small(rng));
    }
  });
  return t;
}

void print_tensor(const Tensor& t, std::ostream& out) {
  out << t.to_string() << "\n  [";
  auto values = t.to_vector<double>();
  constexpr size_t kShown = 16;
  for (size_t i = 0; i < values.size() && i < kShown; ++i) out << (i ? ", " : "") << values[i];
  if (values.size() > kShown) out << ", ... (" << values.size() << " elements)";
  out << "]\n";
}

int run(const std::string& path, const std::vector<std::string>& dims, uint64_t seed,
        std::string graph_name) {
  graph::Module module = graph::parse_module(read_file(path));
  if (graph_name.empty()) graph_name = module.graph_names().front();
  const graph::GraphIR& ir = module.at(graph_name);

  graph::SymbolBindings bindings;
  for (const auto& d : dims) {
    auto eq = d.find('=');
    if (eq == std::string::npos) throw ValueError(fmt::format("--dim '{}': expected name=value", d));
    bindings[d.substr(0, eq)] = std::stoll(d.substr(eq + 1));
  }

  std::mt19937_64 rng(seed);
  WeightsRegistry weights;
  for (const auto& w : ir.weights) weights[w.name] = random_tensor(w.dtype, w.shape.static_dims(), rng);
  std::vector<Tensor> inputs;
  for (const auto& type : ir.input_types()) {
    auto shape = graph::shape_of(type).evaluate(bindings);
    inputs.push_back(graph::is_buffer(type) ? Tensor::zeros(graph::dtype_of(type), shape)
                                            : random_tensor(graph::dtype_of(type), shape, rng));
  }

  engine::InferenceSession session;
  auto models = session.load_all(module, weights);
  auto outputs = models.at(graph_name).execute(inputs);
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::cout << "output " << i << ": ";
    print_tensor(outputs[i], std::cout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kiln: build, compile and run inference graphs"};
  app.require_subcommand(1);

  std::string file;
  bool optimized = false;
  auto* check = app.add_subcommand("check", "Parse and verify a graph text file; print it back");
  check->add_option("file", file, "graph text file")->required();
  check->add_flag("--optimized", optimized, "print the module after the compiler's passes");

  std::vector<std::string> dims;
  uint64_t seed = 0;
  std::string graph_name;
  auto* run_cmd = app.add_subcommand("run", "Compile and run a graph text file on seeded random data");
  run_cmd->add_option("file", file, "graph text file")->required();
  run_cmd->add_option("--dim", dims, "bind a symbolic dim, e.g. --dim batch=4");
  run_cmd->add_option("--seed", seed, "seed of the random weights and inputs");
  run_cmd->add_option("--graph", graph_name, "which graph of the module (default: the first)");

  app.add_subcommand("version", "Print kiln's version");

  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand("version")) {
      std::cout << "kiln " << KILN_VERSION << "\n";
    } else if (app.got_subcommand("check")) {
      graph::Module module = graph::parse_module(read_file(file));
      compiler::passes::verify(module);
      std::cout << graph::print(optimized ? compiler::compile(module).ir() : module);
    } else if (app.got_subcommand("run")) {
      return run(file, dims, seed, graph_name);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kiln: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
