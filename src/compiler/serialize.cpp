// Compiled artifacts: a CompiledModel as a compact, versioned binary file. The file is treated as
// hostile: every count and length is checked against the bytes left before use, every index against
// the table it points into, so a truncated or corrupted file is a LoadError, never a misread.
//
// Layout (little-endian): magic "KILNART\0", u32 format version, str kiln version, str compiled IR
// (graph::print), u32 plan count, then each plan (see write_plan). str = u32 length + bytes.
// Bump kFormatVersion on any layout change; a file of another kiln version is refused as well, since
// plans name kernels and attributes whose meaning may change between versions.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "kiln/compiler/compiled_model.h"
#include "kiln/errors.h"
#include "kiln/graph/text.h"
#include "kiln/version.h"

namespace kiln::compiler {

namespace {

constexpr std::string_view kMagic{"KILNART\0", 8};
// 2: alias values and GraphPlan::aliases; 3: the rope op; 4: grouped_matmul, inserted among the fused
// ops, which renumbers qmatmul and dequantize (plans store op codes); 6: paged_kv_store and
// paged_attention.
constexpr uint32_t kFormatVersion = 6;
#define KILN_COUNT_OP(e, s) +1
constexpr uint32_t kNumOps = 0 KILN_OPS(KILN_COUNT_OP);
#undef KILN_COUNT_OP
constexpr size_t kNumDTypes = std::size(kAllDTypes);
static_assert(std::endian::native == std::endian::little, "artifacts are written little-endian");

// ---- writing ---------------------------------------------------------------------------------------

class Writer {
 public:
  template <class T>
  void pod(T value) {
    char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    out_.append(bytes, sizeof(T));
  }
  void count(size_t n) { pod(static_cast<uint32_t>(n)); }
  void bytes(const void* data, size_t n) {
    count(n);
    out_.append(static_cast<const char*>(data), n);
  }
  void str(std::string_view s) { bytes(s.data(), s.size()); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

void write_shape(Writer& w, const graph::Shape& shape) {
  w.count(static_cast<size_t>(shape.rank()));
  for (const graph::Dim& d : shape) w.str(d.to_string());
}

void write_device(Writer& w, DeviceRef d) {
  w.pod(static_cast<uint8_t>(d.kind));
  w.pod(static_cast<int32_t>(d.id));
}

void write_attrs(Writer& w, const graph::Attrs& attrs) {
  w.count(attrs.size());
  for (const auto& [name, attr] : attrs) {
    w.str(name);
    w.pod(static_cast<uint8_t>(attr.index()));
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
            w.pod(v);
          } else if constexpr (std::is_same_v<T, std::string>) {
            w.str(v);
          } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
            w.count(v.size());
            for (int64_t x : v) w.pod(x);
          } else if constexpr (std::is_same_v<T, graph::Shape>) {
            write_shape(w, v);
          } else if constexpr (std::is_same_v<T, DType>) {
            w.pod(static_cast<uint8_t>(v));
          } else if constexpr (std::is_same_v<T, DeviceRef>) {
            write_device(w, v);
          } else if constexpr (std::is_same_v<T, graph::Bytes>) {
            w.bytes(v.data(), v.size());
          } else {
            static_assert(std::is_same_v<T, std::vector<graph::Type>>);
            w.count(v.size());
            for (const graph::Type& t : v) w.str(graph::to_string(t));
          }
        },
        attr);
  }
}

void write_indices(Writer& w, const std::vector<int32_t>& indices) {
  w.count(indices.size());
  for (int32_t i : indices) w.pod(i);
}

void write_steps(Writer& w, const std::vector<Step>& steps) {
  w.count(steps.size());
  for (const Step& step : steps) {
    w.pod(static_cast<uint16_t>(step.op));
    write_indices(w, step.inputs);
    write_indices(w, step.outputs);
    write_attrs(w, step.attrs);
    w.pod(step.node);
    w.pod(step.extension);
    // The kernel key's op is the step's own (select_kernels).
    w.pod(static_cast<uint8_t>(step.kernel.device));
    w.pod(static_cast<uint8_t>(step.kernel.dtype));
  }
}

void write_types(Writer& w, const std::vector<graph::Type>& types) {
  w.count(types.size());
  for (const graph::Type& t : types) w.str(graph::to_string(t));
}

void write_plan(Writer& w, const GraphPlan& plan) {
  w.str(plan.name);
  write_types(w, plan.input_types);
  write_types(w, plan.output_types);
  w.count(plan.weights.size());
  for (const graph::Weight& weight : plan.weights) {
    w.str(weight.name);
    w.pod(static_cast<uint8_t>(weight.dtype));
    write_shape(w, weight.shape);
    write_device(w, weight.device);
  }
  w.count(plan.values.size());
  for (const PlanValue& value : plan.values) {
    w.str(graph::to_string(value.type));
    w.pod(static_cast<uint8_t>(value.kind));
    w.pod(value.slot);
    w.str(value.weight);
    w.pod(value.input);
    w.pod(value.alias);
    w.pod(value.root);
  }
  write_steps(w, plan.steps);
  write_steps(w, plan.constants);
  write_steps(w, plan.aliases);
  write_indices(w, plan.outputs);
  w.pod(plan.num_slots);
  w.count(plan.extensions.size());
  for (const ExtensionRef& ref : plan.extensions) {
    w.str(ref.path.string());
    w.pod(ref.content_hash);
  }
}

// ---- reading ---------------------------------------------------------------------------------------

class Reader {
 public:
  Reader(std::string_view data, std::string_view origin) : data_(data), origin_(origin) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw LoadError(
        fmt::format("compiled artifact '{}': {} (at byte {} of {})", origin_, what, pos_, data_.size()));
  }
  size_t remaining() const { return data_.size() - pos_; }

  template <class T>
  T pod(const char* what) {
    if (remaining() < sizeof(T)) fail(fmt::format("truncated while reading {}", what));
    T value;
    std::memcpy(&value, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  // A count of elements each at least `min_element_bytes` long, checked against the bytes left.
  size_t count(const char* what, size_t min_element_bytes) {
    auto n = static_cast<size_t>(pod<uint32_t>(what));
    if (n > remaining() / std::max<size_t>(min_element_bytes, 1))
      fail(fmt::format("{} count {} exceeds the {} bytes left", what, n, remaining()));
    return n;
  }
  std::string_view bytes(const char* what) {
    size_t n = count(what, 1);
    std::string_view s = data_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string str(const char* what) { return std::string(bytes(what)); }
  bool at_end() const { return pos_ == data_.size(); }

 private:
  std::string_view data_;
  std::string_view origin_;
  size_t pos_ = 0;
};

DType read_dtype(Reader& r) {
  auto d = r.pod<uint8_t>("dtype");
  if (d >= kNumDTypes) r.fail(fmt::format("dtype code {} is not a dtype", d));
  return static_cast<DType>(d);
}

DeviceRef read_device(Reader& r) {
  auto kind = r.pod<uint8_t>("device kind");
  if (kind > static_cast<uint8_t>(DeviceKind::GPU)) r.fail(fmt::format("device kind {} is unknown", kind));
  auto id = r.pod<int32_t>("device id");
  if (id < 0) r.fail(fmt::format("device id {} is negative", id));
  return {static_cast<DeviceKind>(kind), id};
}

// Text parsers of the graph layer throw their own errors; a file's bad text is a LoadError.
template <class F>
auto parse_or_fail(Reader& r, const char* what, const std::string& text, F&& parse) {
  try {
    return parse(text);
  } catch (const std::exception& e) {
    r.fail(fmt::format("bad {} '{}': {}", what, text.substr(0, 80), e.what()));
  }
}

graph::Shape read_shape(Reader& r) {
  size_t rank = r.count("shape rank", 4);
  if (rank > static_cast<size_t>(graph::kMaxRank))
    r.fail(fmt::format("shape rank {} is more than {}", rank, graph::kMaxRank));
  std::vector<graph::Dim> dims;
  for (size_t i = 0; i < rank; ++i)
    dims.push_back(
        parse_or_fail(r, "dim", r.str("dim"), [](const std::string& t) { return graph::Dim::parse(t); }));
  return graph::Shape(std::move(dims));
}

graph::Type read_type(Reader& r) {
  return parse_or_fail(r, "type", r.str("type"), [](const std::string& t) { return graph::parse_type(t); });
}

std::vector<graph::Type> read_types(Reader& r, const char* what) {
  size_t n = r.count(what, 4);
  std::vector<graph::Type> types;
  for (size_t i = 0; i < n; ++i) types.push_back(read_type(r));
  return types;
}

graph::Attrs read_attrs(Reader& r) {
  size_t n = r.count("attribute", 5);
  graph::Attrs attrs;
  for (size_t i = 0; i < n; ++i) {
    std::string name = r.str("attribute name");
    auto kind = r.pod<uint8_t>("attribute kind");
    graph::Attr attr;
    switch (kind) {
      case 0:
        attr = r.pod<int64_t>("int attribute");
        break;
      case 1:
        attr = r.pod<double>("float attribute");
        break;
      case 2:
        attr = r.str("string attribute");
        break;
      case 3: {
        std::vector<int64_t> v(r.count("int list attribute", 8));
        for (int64_t& x : v) x = r.pod<int64_t>("int list element");
        attr = std::move(v);
        break;
      }
      case 4:
        attr = read_shape(r);
        break;
      case 5:
        attr = read_dtype(r);
        break;
      case 6:
        attr = read_device(r);
        break;
      case 7: {
        std::string_view b = r.bytes("bytes attribute");
        attr = graph::Bytes(b.begin(), b.end());
        break;
      }
      case 8:
        attr = read_types(r, "type list attribute");
        break;
      default:
        r.fail(fmt::format("attribute '{}' has unknown kind {}", name, kind));
    }
    static_assert(std::variant_size_v<graph::Attr> == 9, "read_attrs misses an Attr kind");
    if (!attrs.emplace(std::move(name), std::move(attr)).second) r.fail("duplicate attribute name");
  }
  return attrs;
}

std::vector<int32_t> read_indices(Reader& r, const char* what, size_t limit) {
  std::vector<int32_t> indices(r.count(what, 4));
  for (int32_t& i : indices) {
    i = r.pod<int32_t>(what);
    if (i < 0 || static_cast<size_t>(i) >= limit)
      r.fail(fmt::format("{} {} is out of range (table of {})", what, i, limit));
  }
  return indices;
}

std::vector<Step> read_steps(Reader& r, size_t num_values) {
  size_t n = r.count("step", 22);
  std::vector<Step> steps(n);
  for (Step& step : steps) {
    auto op = r.pod<uint16_t>("op");
    if (op >= kNumOps) r.fail(fmt::format("op code {} is not an op", op));
    step.op = static_cast<graph::Op>(op);
    step.inputs = read_indices(r, "step input", num_values);
    step.outputs = read_indices(r, "step output", num_values);
    step.attrs = read_attrs(r);
    step.node = r.pod<int32_t>("step node");
    step.extension = r.pod<int32_t>("step extension");
    auto kind = r.pod<uint8_t>("step kernel device kind");
    if (kind > static_cast<uint8_t>(DeviceKind::GPU)) r.fail(fmt::format("step kernel device kind {} is unknown", kind));
    auto dtype = r.pod<uint8_t>("step kernel dtype");
    if (dtype >= kNumDTypes) r.fail(fmt::format("step kernel dtype code {} is not a dtype", dtype));
    step.kernel = {step.op, static_cast<DeviceKind>(kind), static_cast<DType>(dtype)};
  }
  return steps;
}

// The executor computes an alias's memory from its source's without further checks of the table, so
// every link is checked here: each alias step makes exactly its value, from a source that is listed
// before it (no cycles), and each alias value names its step and the root at the end of its chain.
void check_aliases(Reader& r, const GraphPlan& plan) {
  for (size_t a = 0; a < plan.aliases.size(); ++a) {
    const Step& step = plan.aliases[a];
    if (step.op != graph::Op::reshape && step.op != graph::Op::slice && step.op != graph::Op::buffer_load)
      r.fail(fmt::format("graph '{}': alias {} is a {}, which cannot be an alias", plan.name, a,
                         graph::op_name(step.op)));
    if (step.inputs.size() != 1 || step.outputs.size() != 1)
      r.fail(fmt::format("graph '{}': alias {} has {} inputs and {} outputs, expected 1 and 1", plan.name, a,
                         step.inputs.size(), step.outputs.size()));
    const PlanValue& value = plan.values[static_cast<size_t>(step.outputs[0])];
    const PlanValue& source = plan.values[static_cast<size_t>(step.inputs[0])];
    if (value.kind != ValueKind::alias || value.alias != static_cast<int32_t>(a))
      r.fail(fmt::format("graph '{}': alias {} makes value %{}, which is not that alias", plan.name, a,
                         step.outputs[0]));
    if (source.kind == ValueKind::alias && source.alias >= static_cast<int32_t>(a))
      r.fail(fmt::format("graph '{}': alias {} views alias {}, which is not listed before it", plan.name, a,
                         source.alias));
    const int32_t root = source.kind == ValueKind::alias ? source.root : step.inputs[0];
    if (value.root != root)
      r.fail(fmt::format("graph '{}': alias value %{} names root %{}, but its chain ends at %{}", plan.name,
                         step.outputs[0], value.root, root));
    if (graph::dtype_of(value.type) != graph::dtype_of(source.type) || graph::is_buffer(value.type))
      r.fail(fmt::format("graph '{}': alias value %{} ({}) is not a tensor of its source's dtype ({})", plan.name,
                         step.outputs[0], graph::to_string(value.type), graph::to_string(source.type)));
  }
  for (size_t v = 0; v < plan.values.size(); ++v) {
    const PlanValue& value = plan.values[v];
    const bool is_alias = value.kind == ValueKind::alias;
    if (is_alias ? value.alias < 0 || static_cast<size_t>(value.alias) >= plan.aliases.size() ||
                       plan.aliases[static_cast<size_t>(value.alias)].outputs[0] != static_cast<int32_t>(v)
                 : value.alias != -1 || value.root != -1)
      r.fail(fmt::format("graph '{}': value %{} has alias index {} and root {}, which do not match its kind",
                         plan.name, v, value.alias, value.root));
  }
}

GraphPlan read_plan(Reader& r) {
  GraphPlan plan;
  plan.name = r.str("graph name");
  plan.input_types = read_types(r, "input type");
  plan.output_types = read_types(r, "output type");
  size_t num_weights = r.count("weight", 13);
  for (size_t i = 0; i < num_weights; ++i) {
    graph::Weight w;
    w.name = r.str("weight name");
    w.dtype = read_dtype(r);
    w.shape = read_shape(r);
    w.device = read_device(r);
    plan.weights.push_back(std::move(w));
  }
  size_t num_values = r.count("value", 25);
  plan.values.resize(num_values);
  for (PlanValue& value : plan.values) {
    value.type = read_type(r);
    auto kind = r.pod<uint8_t>("value kind");
    if (kind > static_cast<uint8_t>(ValueKind::alias)) r.fail(fmt::format("value kind {} is unknown", kind));
    value.kind = static_cast<ValueKind>(kind);
    value.slot = r.pod<int32_t>("value slot");
    value.weight = r.str("value weight");
    value.input = r.pod<int32_t>("value input");
    value.alias = r.pod<int32_t>("value alias");
    value.root = r.pod<int32_t>("value root");
  }
  // Extensions come after the steps that index them; those indices are checked once they are read.
  plan.steps = read_steps(r, num_values);
  plan.constants = read_steps(r, num_values);
  plan.aliases = read_steps(r, num_values);
  plan.outputs = read_indices(r, "plan output", num_values);
  plan.num_slots = r.pod<int32_t>("slot count");
  if (plan.num_slots < 0 || static_cast<size_t>(plan.num_slots) > num_values)
    r.fail(fmt::format("slot count {} is out of range", plan.num_slots));
  size_t num_extensions = r.count("extension", 12);
  for (size_t i = 0; i < num_extensions; ++i) {
    ExtensionRef ref;
    ref.path = r.str("extension path");
    ref.content_hash = r.pod<uint64_t>("extension hash");
    plan.extensions.push_back(std::move(ref));
  }
  for (const auto* steps : {&plan.steps, &plan.constants, &plan.aliases})
    for (const Step& step : *steps)
      if (step.extension < -1 || step.extension >= static_cast<int64_t>(num_extensions))
        r.fail(
            fmt::format("step extension {} is out of range ({} extensions)", step.extension, num_extensions));
  if (plan.output_types.size() != plan.outputs.size())
    r.fail(fmt::format("graph '{}' declares {} outputs but returns {}", plan.name, plan.output_types.size(),
                       plan.outputs.size()));
  for (const PlanValue& value : plan.values) {
    if (value.kind == ValueKind::slot && (value.slot < 0 || value.slot >= plan.num_slots))
      r.fail(fmt::format("graph '{}': slot {} is out of range ({} slots)", plan.name, value.slot,
                         plan.num_slots));
    if (value.kind == ValueKind::input &&
        (value.input < 0 || static_cast<size_t>(value.input) >= plan.input_types.size()))
      r.fail(fmt::format("graph '{}': input index {} is out of range ({} inputs)", plan.name, value.input,
                         plan.input_types.size()));
  }
  check_aliases(r, plan);
  return plan;
}

}  // namespace

std::string CompiledModel::serialize() const {
  Writer w;
  w.pod(std::array<char, 8>{'K', 'I', 'L', 'N', 'A', 'R', 'T', '\0'});
  w.pod(kFormatVersion);
  w.str(KILN_VERSION_STRING);
  w.str(ir_ ? graph::print(*ir_) : lazy_ir_ ? lazy_ir_->text : std::string());
  w.count(plans_.size());
  for (const auto& [name, plan] : plans_) write_plan(w, plan);
  return w.take();
}

CompiledModel CompiledModel::deserialize(std::string_view bytes, std::string_view origin) {
  Reader r(bytes, origin);
  if (bytes.substr(0, kMagic.size()) != kMagic) r.fail("not a kiln compiled artifact (bad magic)");
  r.pod<std::array<char, 8>>("magic");
  auto format = r.pod<uint32_t>("format version");
  if (format != kFormatVersion) r.fail(fmt::format("format version {}, expected {}", format, kFormatVersion));
  std::string version = r.str("kiln version");
  if (version != KILN_VERSION_STRING)
    r.fail(fmt::format("written by kiln {}, this is kiln {} (recompile the model)", version.substr(0, 40),
                       KILN_VERSION_STRING));
  std::string ir_text = r.str("compiled IR");
  std::map<std::string, GraphPlan> plans;
  size_t num_plans = r.count("plan", 30);
  for (size_t i = 0; i < num_plans; ++i) {
    GraphPlan plan = read_plan(r);
    std::string name = plan.name;
    if (!plans.emplace(name, std::move(plan)).second) r.fail(fmt::format("duplicate graph '{}'", name));
  }
  if (!r.at_end()) r.fail(fmt::format("{} unexpected bytes after the last plan", r.remaining()));
  // The IR is parsed on first use: a warm compile-cache load needs only the plans.
  CompiledModel model;
  model.plans_ = std::move(plans);
  model.lazy_ir_ = std::make_shared<LazyIR>();
  model.lazy_ir_->text = std::move(ir_text);
  model.lazy_ir_->origin = origin;
  return model;
}

const graph::Module& CompiledModel::ir() const {
  if (ir_) return *ir_;
  if (!lazy_ir_) throw ValueError("CompiledModel::ir: an empty CompiledModel (get one from compile or load)");
  LazyIR& lazy = *lazy_ir_;
  std::call_once(lazy.parsed, [&] {
    try {
      lazy.module = std::make_shared<const graph::Module>(graph::parse_module(lazy.text));
    } catch (const std::exception& e) {
      throw LoadError(fmt::format("compiled artifact '{}': bad compiled IR: {}", lazy.origin, e.what()));
    }
  });
  return *lazy.module;
}

void CompiledModel::save(const std::filesystem::path& file) const {
  std::string bytes = serialize();
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(fmt::format("CompiledModel::save: cannot open '{}' for writing", file.string()));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.flush()) throw Error(fmt::format("CompiledModel::save: cannot write '{}'", file.string()));
}

CompiledModel CompiledModel::load(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary | std::ios::ate);
  if (!in) throw LoadError(fmt::format("compiled artifact '{}': cannot open the file", file.string()));
  // A directory opens, and its tellg is 2^63 - 1: only a regular file's size is one to allocate.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec))
    throw LoadError(fmt::format("compiled artifact '{}': not a regular file", file.string()));
  const std::streamoff size = in.tellg();
  if (size < 0) throw LoadError(fmt::format("compiled artifact '{}': cannot read the file", file.string()));
  std::string bytes(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size())))
    throw LoadError(fmt::format("compiled artifact '{}': cannot read the file", file.string()));
  return deserialize(bytes, file.string());
}

}  // namespace kiln::compiler
