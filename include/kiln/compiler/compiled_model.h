// The compiler's product: an executable plan per graph of a Module, runnable without the IR.
// Weights are not part of it (only their names and types), so one CompiledModel can be initialised
// with any registry that matches.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/compiler/kernel_catalog.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/kernel_key.h"

namespace kiln::ext {
class ExtensionRegistry;  // kiln/ext/extensions.h
}

namespace kiln::compiler {

// One kernel launch of a plan. Values are indices into the plan's value table.
struct Step {
  graph::Op op;
  std::vector<int32_t> inputs;
  std::vector<int32_t> outputs;
  graph::Attrs attrs;
  int32_t node = -1;  // index of the node in the compiled (post-pass) graph, for error messages
  int32_t extension = -1;  // custom ops: index into GraphPlan::extensions of the library defining it
  graph::KernelKey kernel;  // the kernel that runs it, chosen by select_kernels
};

// A custom-kernel library a plan calls, by path and the content hash it was compiled against.
struct ExtensionRef {
  std::filesystem::path path;
  uint64_t content_hash = 0;
  bool operator==(const ExtensionRef&) const = default;
};

// How a plan value gets its memory at run time.
enum class ValueKind : uint8_t {
  input,     // a graph input (borrowed from the caller; buffers are written in place)
  weight,    // bound at init
  constant,  // materialised once at init from the step that makes it (GraphPlan::constants)
  slot,      // an intermediate in a reused arena slot (see memory planning)
  output,    // a graph output: fresh memory handed to the caller
  alias,     // no memory of its own: a contiguous window of another value's (see GraphPlan::aliases)
};
// A graph output whose value is an input, weight, constant or alias keeps that kind; the engine
// returns a copy of it, so an output never shares memory with the caller's inputs, the model's state
// or another output.

struct PlanValue {
  graph::Type type;  // symbolic shape, evaluated when the model runs
  ValueKind kind = ValueKind::slot;
  int32_t slot = -1;      // for slot values: the arena slot shared by values whose lifetimes don't overlap
  std::string weight;     // for weight values: its name
  int32_t input = -1;     // for input values: the input index
  int32_t alias = -1;     // for alias values: index into GraphPlan::aliases, the step it replaces
  int32_t root = -1;      // for alias values: the value owning the memory (never itself an alias)
};

struct GraphPlan {
  std::string name;
  std::vector<graph::Type> input_types;
  std::vector<graph::Type> output_types;
  std::vector<graph::Weight> weights;
  std::vector<PlanValue> values;
  std::vector<Step> steps;            // in execution order (no weight or constant steps)
  std::vector<Step> constants;        // `constant` kernels, run once at init
  // Steps that launch no kernel because their result is a contiguous window of their operand's
  // memory (docs/memory-planning.md): reshape, and slice / buffer_load of one contiguous block. Each
  // has one input (the source, possibly an alias listed earlier) and one output (an alias value); the
  // executor resolves them in this order each run, evaluating symbolic bounds into a byte offset.
  std::vector<Step> aliases;
  std::vector<int32_t> outputs;       // plan values returned, in order
  int32_t num_slots = 0;
  std::vector<ExtensionRef> extensions;  // libraries whose custom ops the steps call
};

// A plan as text, for inspection and tests: one line per value (its type and where its memory is:
// input, weight, constant, slot, output, or alias of its root), then the steps and the aliases, e.g.
//   graph 'g': 2 steps, 1 alias, 1 slot
//   %0 f32[2, 3] input 0
//   %1 f32[2, 3] slot 0
//   %2 f32[6] alias of %1
//   step exp %0 -> %1
//   alias reshape %1 -> %2
std::string to_string(const GraphPlan& plan);

class CompiledModel {
 public:
  CompiledModel() = default;
  CompiledModel(graph::Module compiled_ir, std::map<std::string, GraphPlan> plans)
      : ir_(std::make_shared<graph::Module>(std::move(compiled_ir))), plans_(std::move(plans)) {}

  std::vector<std::string> graph_names() const;
  const GraphPlan& plan(const std::string& graph) const;  // ValueError naming the graph
  const std::map<std::string, GraphPlan>& plans() const { return plans_; }
  // The module after all passes (printable; what the plans were made from). A loaded artifact parses
  // it on first use (the plans run without it), so a corrupted IR text is a LoadError here.
  const graph::Module& ir() const;
  // The custom-kernel libraries its graphs call (empty for a model without custom ops).
  std::vector<ExtensionRef> extensions() const;

  // Artifacts: the plans and the compiled IR (no weights) in a versioned binary file. load() rejects a
  // truncated, corrupted or foreign file, or one written by another kiln version, with a LoadError
  // naming the file and what is wrong; it never misreads one.
  void save(const std::filesystem::path& file) const;
  static CompiledModel load(const std::filesystem::path& file);
  std::string serialize() const;  // the file's bytes
  static CompiledModel deserialize(std::string_view bytes, std::string_view origin = "artifact");

 private:
  struct LazyIR {  // a loaded artifact's IR text, parsed by the first ir()
    std::once_flag parsed;
    std::string text, origin;
    std::shared_ptr<const graph::Module> module;
  };
  std::shared_ptr<const graph::Module> ir_;
  std::shared_ptr<LazyIR> lazy_ir_;
  std::map<std::string, GraphPlan> plans_;
};

struct CompileOptions {
  bool optimize = true;  // run canonicalize, constant-fold, CSE, DCE, fusion; verify always runs
  // The libraries custom ops resolve against (must outlive the compile call); nullptr: none.
  const ext::ExtensionRegistry* extensions = nullptr;
  // The kernels the model will run with (InferenceSession::kernel_catalog(); must outlive the call):
  // select_kernels checks every step has one, constant folding runs them, fusion and matmul grouping
  // make only nodes they have. nullptr: none of that (no folding, fusion or grouping; the engine
  // finds a missing kernel at init).
  const KernelCatalog* kernels = nullptr;
};

// Verifies, optimizes and plans every graph in the module. VerifyError/ShapeError/DTypeError name
// the graph, node and operand at fault; an (op, device, dtype) without a kernel in options.kernels
// is an Error naming it.
// Every custom op must be defined by a library of options.extensions, called the way it was
// registered (in place or not), with the parameters it declares and the output types its
// output-type function gives; else an ExtensionError naming the graph, node, op and loaded paths.
CompiledModel compile(const graph::Module& module, const CompileOptions& options = {});

// The key a compile cache stores `compile(module, options)` under: a hash (16 hex digits) of the
// printed module, the compiler version, the options, and, for each custom op the module calls, the
// content hash of the library defining it. A rebuilt library changes the key of exactly the graphs
// that call it; a graph without custom ops has the same key whatever extensions are loaded.
std::string cache_key(const graph::Module& module, const CompileOptions& options = {});

}  // namespace kiln::compiler
