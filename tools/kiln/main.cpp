// The `kiln` command (`kiln` or `kiln help` prints the usage; `kiln --version`).
//   kiln check FILE [--optimized]           parse and verify a graph text file, print it back
//   kiln run FILE [--dim name=N ...] [--seed S] [--graph NAME]
//                                           compile it, bind seeded random weights and inputs, run it,
//                                           print the outputs
//   kiln generate [-m DIR|FILE|NAME] -p TEXT | -f FILE|- [-n N|-1] [--temp T --top-k K --top-p P
//                 --min-p M --repeat-penalty R -s SEED --stop S -r S --echo -t N -c L --ignore-eos --dtype F]
//                                           generate text, with llama.cpp's flags (stdout: the new text
//                                           only, unless --echo; stderr: the seed, progress and stats;
//                                           Ctrl-C ends it after the current token, exit status 130).
//                                           NAME: a random-weight shape (stories15M, stories110M,
//                                           llama-1B) run on --prompt-tokens N ids, printing ids
//   kiln chat [-m DIR] [--system TEXT]      a chat in the terminal, through the model's chat template
//   kiln serve [-m DIR] [--port P]          the OpenAI-compatible HTTP server
//   kiln graph [--model DIR|NAME]           print the text generation graphs (model, sampler, greedy)
//   kiln cache list|size|clear [--dir DIR]  the compile cache (default: KILN_CACHE_DIR, else
//                                           $XDG_CACHE_HOME/kiln or ~/.cache/kiln) and the packed-
//                                           weight cache (its weights/): list the entries (least
//                                           recently used first), print the sizes, empty them
//   kiln bench [--model NAME|DIR ...] | gemm | bandwidth
//                                           tokens/s against the bandwidth roofline, GEMM against
//                                           oneDNN, read bandwidth (tools/kiln/bench.h)
//   kiln version
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <kiln/engine/compile_cache.h>
#include <kiln/engine/weight_cache.h>
#include <kiln/kiln.h>
#include <kiln/pipelines/gguf_model.h>
#include <kiln/pipelines/hf_config.h>
#include <kiln/pipelines/text_generation.h>
#include <kiln/pipelines/chat_template.h>
#include <kiln/serve/server.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include "bench.h"
#include "chat.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#ifndef KILN_MODEL_FROM_BINDIR
#define KILN_MODEL_FROM_BINDIR "../share/kiln/models/kiln-tiny"
#endif

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
    const auto eq = d.find('=');
    if (eq == std::string::npos || eq == 0)
      throw ValueError(fmt::format("--dim '{}': expected name=value, e.g. --dim seq=5", d));
    const std::string_view value = std::string_view(d).substr(eq + 1);
    int64_t n = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
    if (ec != std::errc() || end != value.data() + value.size() || n < 0)
      throw ValueError(fmt::format("--dim '{}': the value '{}' is not a size (an integer >= 0)", d, value));
    bindings[d.substr(0, eq)] = n;
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

// ---- the embedded model -------------------------------------------------------------------------

// Where `--model` points when it is not given: the embedded model beside the binary, installed
// (<bindir>/KILN_MODEL_FROM_BINDIR, i.e. <prefix>/share/kiln/models/kiln-tiny) or in the build tree
// (<build>/models/kiln-tiny, a link to the source's). The installed place when neither exists, so
// the error names it.
std::string default_model_dir() {
  std::error_code ec;
  const std::filesystem::path exe_dir = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
  if (ec) return "models/kiln-tiny";
  const std::filesystem::path installed = (exe_dir / KILN_MODEL_FROM_BINDIR).lexically_normal();
  const std::filesystem::path build_tree = exe_dir / "models" / "kiln-tiny";
  if (!std::filesystem::is_directory(installed, ec) && std::filesystem::is_directory(build_tree, ec))
    return build_tree.string();
  return installed.string();
}

// ---- options shared by generate and chat ---------------------------------------------------------

// The sampling flags, llama.cpp's names beside kiln's; defaults are llama.cpp's.
struct SamplingArgs {
  double temperature = 0.8;
  int64_t top_k = 40;
  double top_p = 0.95;
  double min_p = 0;
  double repeat_penalty = 1;
  uint64_t seed = 0;
  CLI::Option* seed_option = nullptr;  // given: fixed; not given: drawn at random and printed
  std::vector<std::string> stop;
};

void add_sampling_options(CLI::App* cmd, SamplingArgs& a) {
  cmd->add_option("--temp,--temperature", a.temperature, "sampling temperature (0: greedy)")->capture_default_str();
  cmd->add_option("--top-k", a.top_k, "keep the k most likely tokens (0: off)")->capture_default_str();
  cmd->add_option("--top-p", a.top_p, "nucleus mass (1: off)")->capture_default_str();
  cmd->add_option("--min-p", a.min_p, "keep tokens at least this times as likely as the top one (0: off)")
      ->capture_default_str();
  cmd->add_option("--repeat-penalty", a.repeat_penalty, "divide the logits of tokens already seen (1: off)")
      ->capture_default_str();
  a.seed_option = cmd->add_option("-s,--seed", a.seed, "sampling seed (default: a random one, printed)");
  cmd->add_option("--stop", a.stop, "stop before this string (not printed); repeatable")
      ->allow_extra_args(false);  // one string per flag: `--stop a --stop b`
}

// Each check names the flag and what it accepts, and runs before anything loads.
void check_sampling_args(const SamplingArgs& a) {
  const int64_t cap = pipelines::EngineOptions{}.sampler_max_top_k;
  if (!std::isfinite(a.temperature) || a.temperature < 0)
    throw ValueError(fmt::format("--temp must be a finite number >= 0 (0: greedy), got {}", a.temperature));
  if (a.top_k < 0 || a.top_k > cap)
    throw ValueError(fmt::format("--top-k must be in [0, {}] (0: off; {} is the sampler's cap), got {}", cap, cap,
                                 a.top_k));
  if (!(a.top_p > 0 && a.top_p <= 1)) throw ValueError(fmt::format("--top-p must be in (0, 1], got {}", a.top_p));
  if (!(a.min_p >= 0 && a.min_p <= 1)) throw ValueError(fmt::format("--min-p must be in [0, 1], got {}", a.min_p));
  if (!std::isfinite(a.repeat_penalty) || a.repeat_penalty <= 0)
    throw ValueError(fmt::format("--repeat-penalty must be a finite number > 0 (1: off), got {}", a.repeat_penalty));
  for (const std::string& s : a.stop)
    if (s.empty()) throw ValueError("--stop: a stop string is empty (it would match before any text)");
}

// The seed in effect: --seed's, else a random one, printed so that the run can be repeated.
uint64_t effective_seed(const SamplingArgs& a) {
  if (a.seed_option->count() > 0) return a.seed;
  std::random_device device;
  const uint64_t seed = (uint64_t{device()} << 32) | device();
  std::fprintf(stderr, "kiln: seed %llu (give --seed %llu to repeat this run)\n", static_cast<unsigned long long>(seed),
               static_cast<unsigned long long>(seed));
  return seed;
}

pipelines::SamplingParams sampling_params(const SamplingArgs& a, uint64_t seed) {
  pipelines::SamplingParams p;
  p.temperature = a.temperature;
  p.top_k = a.top_k;
  p.top_p = a.top_p;
  p.min_p = a.min_p;
  p.repetition_penalty = a.repeat_penalty;
  p.seed = seed;
  p.stop = a.stop;
  return p;
}

// --threads, --max-seq-len (llama.cpp's -t, -c), --dtype, --kv-cache-gb, --kv-dtype.
struct EngineArgs {
  int threads = 0;
  int64_t max_seq_len = 0;
  std::string dtype;  // the weight format (docs/quantization.md); empty: the checkpoint's
  double kv_cache_gb = 0;  // 0: the engine's default
  std::string kv_dtype = "f32";
};

// --kv-cache-gb: the KV cache's byte budget (0: the engine's default).
int64_t kv_cache_bytes(double gb) {
  if (!(gb >= 0) || gb > 1e6) throw ValueError(fmt::format("--kv-cache-gb must be in [0, 1e6] GiB, got {}", gb));
  return static_cast<int64_t>(gb * double(int64_t{1} << 30));
}

// --dtype: the weight format, or (not given) the checkpoint's own.
std::optional<nn::WeightFormat> weight_format_option(const std::string& name) {
  if (name.empty()) return std::nullopt;
  try {
    return nn::parse_weight_format(name);
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("--dtype: {}", e.what()));
  }
}

// The engine's options from the flags, each checked (naming the flag) before anything loads.
pipelines::EngineOptions engine_options(const EngineArgs& a) {
  if (a.threads < 0) throw ValueError(fmt::format("-t/--threads must be >= 0 (0: one per core), got {}", a.threads));
  if (a.max_seq_len < 0)
    throw ValueError(fmt::format("-c/--ctx-size must be >= 0 (0: the model's, at most 2048), got {}", a.max_seq_len));
  pipelines::EngineOptions options{.max_seq_len = a.max_seq_len,
                                   .num_threads = a.threads,
                                   .weight_format = weight_format_option(a.dtype)};
  options.kv_cache_dtype = bench::parse_kv_dtype(a.kv_dtype);
  options.kv_cache_bytes = kv_cache_bytes(a.kv_cache_gb);
  return options;
}

void add_engine_options(CLI::App* cmd, EngineArgs& a) {
  cmd->add_option("-t,--threads", a.threads, "engine threads (default: one per core)");
  cmd->add_option("-c,--ctx-size,--max-seq-len", a.max_seq_len,
                  "the context: longest sequence, prompt + generated (default: min(max_position_embeddings, 2048))");
  cmd->add_option("--dtype", a.dtype,
                  "weight format: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k (converted at load; default: a GGUF "
                  "file's own, else f32)");
  cmd->add_option("--kv-cache-gb", a.kv_cache_gb,
                  "KV cache budget in GiB (default: what 64 sequences of the context need, at most a quarter of the "
                  "free memory)");
  cmd->add_option("--kv-dtype", a.kv_dtype, "KV cache dtype: f32, bf16 or f16")->capture_default_str();
}

// --model: an existing directory or file, or a random-weight shape; said before anything loads.
void check_model(const std::string& model) {
  if (pipelines::named_config(model)) return;
  std::error_code ec;
  if (!std::filesystem::exists(model, ec))
    throw LoadError(fmt::format("--model '{}': no such file or directory (a Hugging Face model directory, a GGUF "
                                "file, or a random-weight shape: {})",
                                model, fmt::join(pipelines::named_config_names(), ", ")));
}

// ---- Ctrl-C --------------------------------------------------------------------------------------

// What the SIGINT handler sets and the generate loop polls: a handler can touch nothing else.
std::atomic<bool> sigint_received{false};
extern "C" void on_sigint(int) { sigint_received.store(true); }
static_assert(std::atomic<bool>::is_always_lock_free);

// While it lives, the first Ctrl-C sets the flag (generation ends after the current token); a
// second one, with the default action restored, ends the process at once.
class SigintFlag {
 public:
  SigintFlag() {
    sigint_received.store(false);
    struct sigaction action {};
    action.sa_handler = on_sigint;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESETHAND | SA_RESTART;
    sigaction(SIGINT, &action, &previous_);
  }
  ~SigintFlag() { sigaction(SIGINT, &previous_, nullptr); }
  SigintFlag(const SigintFlag&) = delete;
  SigintFlag& operator=(const SigintFlag&) = delete;
  bool raised() const { return sigint_received.load(); }

 private:
  struct sigaction previous_ {};
};

// ---- generate / graph ----------------------------------------------------------------------------

struct GenerateArgs {
  std::string model = default_model_dir();
  std::string prompt;
  CLI::Option* prompt_option = nullptr;
  std::string prompt_file;  // -f FILE; "-": stdin
  int64_t prompt_tokens = 0;
  int64_t max_new_tokens = 128;  // -1: until the context is full
  SamplingArgs sampling;
  std::vector<std::string> reverse_prompts;
  bool echo = false;
  bool ignore_eos = false;
  EngineArgs engine;
};

// Loading stages on stderr: a bar redrawn in place on a terminal, one line per stage otherwise.
class LoadProgress {
 public:
  LoadProgress() : tty_(isatty(fileno(stderr)) != 0) {}
  void stage(std::string_view name, int index, int total) {
    if (!tty_) {
      std::fprintf(stderr, "kiln: loading %.*s (%d/%d)\n", static_cast<int>(name.size()), name.data(),
                   index + 1, total);
      return;
    }
    constexpr int kWidth = 30;
    const int filled = kWidth * index / total;
    std::fprintf(stderr, "\r\033[K[%s%s] %d/%d loading %.*s",
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(kWidth - filled), ' ').c_str(), index + 1, total,
                 static_cast<int>(name.size()), name.data());
    std::fflush(stderr);
    drawn_ = true;
  }
  void done() {
    if (tty_ && drawn_) std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
  }

 private:
  bool tty_;
  bool drawn_ = false;
};

std::unique_ptr<pipelines::GenerationEngine> load_engine(const std::string& model, pipelines::EngineOptions options,
                                                         uint64_t weights_seed) {
  LoadProgress progress;
  options.on_stage = [&](std::string_view stage, int index, int total) { progress.stage(stage, index, total); };
  std::unique_ptr<pipelines::GenerationEngine> engine;
  if (auto config = pipelines::named_config(model)) {
    progress.stage("random weights", 0, 2);
    WeightsRegistry weights = pipelines::random_weights(*config, weights_seed);
    progress.stage("graphs", 1, 2);
    engine = std::make_unique<pipelines::GenerationEngine>(*config, weights, nullptr, std::vector<int64_t>{},
                                                           std::move(options));
  } else {
    engine = pipelines::GenerationEngine::from_dir(model, std::move(options));
  }
  progress.done();
  return engine;
}

// The closing statistics, as llama.cpp's: load, prompt, generation and total times.
void print_stats(const pipelines::GenerationStats& s, double load_seconds, double total_seconds, bool interrupted) {
  std::fprintf(stderr, "\nload: %.3f s\n", load_seconds);
  std::fprintf(stderr, "prompt: %lld tokens, prefill %.3f s (%.1f tokens/s)\n",
               static_cast<long long>(s.prompt_tokens), s.prefill_seconds, s.prefill_tokens_per_s);
  std::fprintf(stderr, "generated: %lld tokens, decode %.3f s (%.1f tokens/s)\n",
               static_cast<long long>(s.generated_tokens), s.decode_seconds, s.decode_tokens_per_s);
  // From the start to the first token, and the most memory the process held: what a user waits for
  // and what the machine must have (docs/performance.md compares both with llama.cpp's).
  std::fprintf(stderr, "first token: %.3f s after start (load + prefill)\n", load_seconds + s.prefill_seconds);
  std::fprintf(stderr, "total: %.3f s\n", total_seconds);
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) == 0)
    std::fprintf(stderr, "peak memory: %.1f MiB resident\n", static_cast<double>(usage.ru_maxrss) / 1024.0);
  std::fprintf(stderr, "finish: %s%s\n", pipelines::finish_reason_name(s.finish_reason),
               interrupted ? " (interrupted)" : "");
}

// -p TEXT, or -f FILE / -f - (stdin); read before the model loads.
std::string prompt_text(const GenerateArgs& args) {
  if (args.prompt_file.empty()) return args.prompt;
  if (args.prompt_file == "-") {
    std::stringstream ss;
    ss << std::cin.rdbuf();
    return ss.str();
  }
  std::ifstream in(args.prompt_file, std::ios::binary);
  if (!in) throw LoadError(fmt::format("-f/--file '{}': cannot open it", args.prompt_file));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int generate(GenerateArgs args, Clock::time_point started) {
  // Every option, before anything loads.
  const bool named = pipelines::named_config(args.model).has_value();
  const bool has_text_prompt = args.prompt_option->count() > 0 || !args.prompt_file.empty();
  if (args.prompt_option->count() > 0 && !args.prompt_file.empty())
    throw ValueError("give the prompt once: -p/--prompt TEXT or -f/--file FILE, not both");
  if (named && args.prompt_tokens <= 0)
    throw ValueError(
        fmt::format("--model '{}' has random weights and no tokenizer: give --prompt-tokens N (N >= 1)", args.model));
  if (named && has_text_prompt)
    throw ValueError(fmt::format("--model '{}' has no tokenizer: give --prompt-tokens N, not a text prompt", args.model));
  if (!named && args.prompt_tokens != 0)
    throw ValueError("--prompt-tokens is for the random-weight shapes (stories15M, stories110M, llama-1B); give --prompt");
  if (!named && !has_text_prompt)
    throw ValueError("no prompt: give -p/--prompt TEXT or -f/--file FILE (-f - reads stdin); --prompt \"\" starts "
                     "from the model's BOS token");
  if (args.max_new_tokens < -1)
    throw ValueError(fmt::format(
        "-n/--max-new-tokens must be -1 (until the context is full) or >= 0, got {}", args.max_new_tokens));
  check_sampling_args(args.sampling);
  for (const std::string& r : args.reverse_prompts)
    if (r.empty()) throw ValueError("-r/--reverse-prompt: the string is empty (it would match before any text)");
  pipelines::EngineOptions engine_opts = engine_options(args.engine);
  check_model(args.model);
  const std::string prompt = named ? std::string() : prompt_text(args);
  const uint64_t seed = effective_seed(args.sampling);

  pipelines::GenerationRequest request;
  request.sampling = sampling_params(args.sampling, seed);
  request.sampling.max_new_tokens =
      args.max_new_tokens < 0 ? std::numeric_limits<int64_t>::max() : args.max_new_tokens;  // the engine stops at the context
  request.sampling.ignore_eos = args.ignore_eos;
  request.sampling.stop.insert(request.sampling.stop.end(), args.reverse_prompts.begin(), args.reverse_prompts.end());
  pipelines::check_sampling(request.sampling);

  const Clock::time_point load_start = Clock::now();
  auto engine = load_engine(args.model, std::move(engine_opts), seed);
  const double load_seconds = seconds_since(load_start);

  if (named) {
    // A pseudo-random prompt from the seed (BOS = 1 first, as Llama 2), printed as ids like the output.
    std::mt19937_64 rng(seed);
    request.prompt_ids = {1};
    while (static_cast<int64_t>(request.prompt_ids.size()) < args.prompt_tokens)
      request.prompt_ids.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(engine->config().vocab_size)));
  } else if (prompt.empty()) {
    // An empty prompt starts from BOS alone, as llama.cpp does.
    const pipelines::Tokenizer* tokenizer = engine->tokenizer();
    if (tokenizer) request.prompt_ids = tokenizer->encode("");
    if (request.prompt_ids.empty() && tokenizer && tokenizer->bos_id()) request.prompt_ids = {*tokenizer->bos_id()};
    if (request.prompt_ids.empty())
      throw ValueError(fmt::format("--prompt is empty and '{}' has no BOS token to start from", args.model));
  } else {
    request.prompt = prompt;
  }
  if (args.echo) {
    if (named)
      for (int64_t id : request.prompt_ids) std::fprintf(stdout, "%lld ", static_cast<long long>(id));
    else
      std::fwrite(prompt.data(), 1, prompt.size(), stdout);
    std::fflush(stdout);
  }

  SigintFlag sigint;
  pipelines::RequestStream stream = engine->stream(std::move(request));
  pipelines::RequestUpdate last;
  bool cancelled = false;
  while (!stream.done()) {
    if (sigint.raised() && !cancelled) cancelled = engine->cancel(stream.id());
    std::optional<pipelines::RequestUpdate> update = stream.next(std::chrono::milliseconds(50));
    if (!update) continue;
    if (named) {
      for (const pipelines::GeneratedToken& t : update->tokens) std::fprintf(stdout, "%lld ", static_cast<long long>(t.id));
    } else {
      std::fwrite(update->text.data(), 1, update->text.size(), stdout);
    }
    std::fflush(stdout);
    if (update->finish) last = std::move(*update);
  }
  // A reverse prompt (llama.cpp's -r) is shown, then generation stops; a --stop string is not shown.
  if (last.stop_string && std::find(args.reverse_prompts.begin(), args.reverse_prompts.end(), *last.stop_string) !=
                              args.reverse_prompts.end())
    std::fwrite(last.stop_string->data(), 1, last.stop_string->size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (last.finish == pipelines::FinishReason::error) throw ExecutionError("generate: " + last.error);
  const bool interrupted = sigint.raised();
  print_stats(pipelines::generation_stats(last.metrics, last.finish.value_or(pipelines::FinishReason::cancelled)),
              load_seconds, seconds_since(started), interrupted);
  return interrupted ? 130 : 0;  // 128 + SIGINT, as a shell reports a process that SIGINT ended
}

// ---- serve --------------------------------------------------------------------------------------

struct ServeArgs {
  std::string model = default_model_dir();
  std::string model_name;  // default: the directory's or shape's name
  std::string host = "127.0.0.1";
  int port = 8000;
  EngineArgs engine;
  int max_concurrency = 64;
  int max_queue = 256;
  double shutdown_grace_s = 10;
  std::string api_key;
  std::string tokenizer;  // a tokenizer for a random-weight shape (text prompts at real sizes)
  std::string chat_template;  // a template file, over the model's own
};

// The chat template: --chat-template FILE, else the model directory's (or, for a random-weight
// shape, the --tokenizer directory's); null when there is none.
std::shared_ptr<const pipelines::ChatTemplate> load_chat_template(const std::string& file, const std::string& model_dir,
                                                                 const pipelines::Tokenizer* tokenizer) {
  std::optional<pipelines::ChatTemplate> found;
  std::filesystem::path dir = model_dir;
  if (!dir.empty() && !std::filesystem::is_directory(dir) && !pipelines::is_gguf_file(dir)) dir = dir.parent_path();
  if (!dir.empty()) found = pipelines::ChatTemplate::from_model_dir(dir);
  if (!file.empty()) {
    // The file's template, with the model's special tokens (from its tokenizer_config.json, else its tokenizer).
    std::string bos = found ? found->bos_token() : std::string();
    std::string eos = found ? found->eos_token() : std::string();
    if (tokenizer && bos.empty() && tokenizer->bos_id()) bos = tokenizer->decode({*tokenizer->bos_id()}, false);
    if (tokenizer && eos.empty() && tokenizer->eos_id()) eos = tokenizer->decode({*tokenizer->eos_id()}, false);
    found = pipelines::ChatTemplate::from_file(file, bos, eos);
  }
  if (!found) return nullptr;
  return std::make_shared<const pipelines::ChatTemplate>(std::move(*found));
}

// Serves until SIGINT or SIGTERM, blocked in every thread and awaited by this one, which then shuts
// the server down gracefully: no new requests, those in flight given --shutdown-grace seconds.
int serve_command(const ServeArgs& args) {
  if (args.port < 0 || args.port > 65535) throw ValueError(fmt::format("--port must be in [0, 65535], got {}", args.port));
  if (args.max_concurrency < 1)
    throw ValueError(fmt::format("--max-concurrency must be >= 1, got {}", args.max_concurrency));
  if (args.max_queue < 0) throw ValueError(fmt::format("--max-queue must be >= 0, got {}", args.max_queue));
  if (!(args.shutdown_grace_s >= 0))
    throw ValueError(fmt::format("--shutdown-grace must be >= 0 seconds, got {}", args.shutdown_grace_s));
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  pipelines::EngineOptions options = engine_options(args.engine);
  options.max_num_seqs = args.max_concurrency;
  LoadProgress progress;
  options.on_stage = [&](std::string_view stage, int index, int total) { progress.stage(stage, index, total); };
  std::shared_ptr<pipelines::GenerationEngine> engine;
  const std::optional<nn::LlamaConfig> config = pipelines::named_config(args.model);
  if (config) {
    std::shared_ptr<const pipelines::Tokenizer> tokenizer;
    if (!args.tokenizer.empty()) tokenizer = pipelines::Tokenizer::load(args.tokenizer);
    progress.stage("random weights", 0, 2);
    engine = std::make_shared<pipelines::GenerationEngine>(*config, pipelines::random_weights(*config, 0),
                                                          std::move(tokenizer), std::vector<int64_t>{}, options);
  } else {
    if (!args.tokenizer.empty())
      throw ValueError("--tokenizer is for the random-weight shapes; a model directory has its own");
    engine = pipelines::GenerationEngine::from_dir(args.model, options);
  }
  progress.done();
  serve::ServerOptions server_options{.host = args.host, .port = args.port};
  server_options.model_name =
      !args.model_name.empty() ? args.model_name : std::filesystem::path(args.model).filename().string();
  if (!args.api_key.empty()) server_options.api_key = args.api_key;
  server_options.max_concurrency = args.max_concurrency;
  server_options.max_queue = args.max_queue;
  server_options.chat_template =
      load_chat_template(args.chat_template, config ? args.tokenizer : args.model, engine->tokenizer());
  serve::Server server(engine, server_options);
  const int port = server.start();
  std::fprintf(stderr,
               "kiln: serving '%s' on http://%s:%d (OpenAI API: /v1/completions, /v1/chat/completions%s, /v1/models; "
               "/health, /metrics)\n",
               server_options.model_name.c_str(), args.host.c_str(), port,
               server_options.chat_template ? "" : " [no chat template]");
  int signal = 0;
  sigwait(&signals, &signal);
  std::fprintf(stderr, "kiln: stopping (signal %d): finishing requests in flight for up to %g s\n", signal,
               args.shutdown_grace_s);
  server.shutdown(std::chrono::milliseconds(static_cast<int64_t>(args.shutdown_grace_s * 1000)));
  std::fprintf(stderr, "kiln: stopped\n");
  return 0;
}

// ---- chat ---------------------------------------------------------------------------------------

struct ChatArgs {
  std::string model = default_model_dir();
  std::string chat_template;
  std::string system;
  int64_t max_tokens = 0;  // per reply; 0: the rest of the context
  SamplingArgs sampling;
  EngineArgs engine;
};

int chat_command(const ChatArgs& args) {
  // Every option, before the model loads.
  check_sampling_args(args.sampling);
  if (args.max_tokens < 0)
    throw ValueError(fmt::format("-n/--max-tokens must be >= 0 (0: the rest of the context), got {}", args.max_tokens));
  pipelines::EngineOptions options = engine_options(args.engine);
  options.max_num_seqs = 1;
  if (pipelines::named_config(args.model))
    throw ValueError(fmt::format("kiln chat needs a model directory with a tokenizer; '{}' is a random-weight shape",
                                 args.model));
  check_model(args.model);
  chat::ChatOptions chat_options;
  chat_options.system = args.system;
  chat_options.sampling = sampling_params(args.sampling, effective_seed(args.sampling));
  chat_options.sampling.max_new_tokens = args.max_tokens;
  pipelines::check_sampling(chat_options.sampling);

  auto engine = load_engine(args.model, std::move(options), 0);
  auto chat_template = load_chat_template(args.chat_template, args.model, engine->tokenizer());
  if (!chat_template)
    throw ValueError(fmt::format("'{}' has no chat template (tokenizer_config.json's chat_template or "
                                 "chat_template.jinja): give --chat-template FILE",
                                 args.model));
  chat_options.prompt_marks = isatty(fileno(stdin)) != 0;
  if (chat_options.prompt_marks) std::fprintf(stderr, "kiln chat: /reset forgets the conversation, /exit ends it\n");
  chat::run_chat(*engine, *chat_template, chat_options, std::cin, std::cout, std::cerr);
  return 0;
}

int print_graphs(const std::string& model, int64_t max_seq_len) {
  nn::LlamaConfig config;
  if (auto named = pipelines::named_config(model))
    config = *named;
  else
    config = pipelines::load_model_info(model).config;
  pipelines::PipelineOptions options{.max_seq_len = max_seq_len};
  std::cout << graph::print(pipelines::TextGenerationPipeline::trace_graphs(config, options));
  return 0;
}

// `kiln cache list|size|clear`.
int cache_command(const CLI::App& cmd, const std::string& dir) {
  // The compiled models in DIR, the packed weights in DIR/weights (engine::WeightCache).
  const engine::CompileCache compiled(dir);
  const engine::WeightCache weights(dir.empty() ? std::filesystem::path() : std::filesystem::path(dir) / "weights");
  auto print_entries = [](const char* kind, const std::vector<engine::CacheEntry>& entries) {
    for (const engine::CacheEntry& e : entries) {
      auto age = std::chrono::duration_cast<std::chrono::seconds>(std::filesystem::file_time_type::clock::now() -
                                                                  e.last_used);
      std::cout << fmt::format("{}  {}  {:>12} bytes  used {}s ago\n", kind, e.key, e.bytes, age.count());
    }
  };
  if (cmd.got_subcommand("list")) {
    print_entries("compiled", compiled.entries());
    print_entries("weights ", weights.entries());
  } else if (cmd.got_subcommand("size")) {
    std::cout << fmt::format("{}: {} compiled models, {} bytes (limit {} bytes)\n", compiled.dir().string(),
                             compiled.entries().size(), compiled.size_bytes(), compiled.max_bytes());
    std::cout << fmt::format("{}: {} packed weights, {} bytes (limit {} bytes)\n", weights.dir().string(),
                             weights.entries().size(), weights.size_bytes(), weights.max_bytes());
  } else if (cmd.got_subcommand("clear")) {
    std::cout << fmt::format("{}: removed {} compiled models\n", compiled.dir().string(), compiled.clear());
    std::cout << fmt::format("{}: removed {} packed weights\n", weights.dir().string(), weights.clear());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Clock::time_point started = Clock::now();
  CLI::App app{"kiln: build, compile and run inference graphs, and generate text with them", "kiln"};
  app.require_subcommand(0, 1);
  app.set_version_flag("--version", "kiln " KILN_VERSION_STRING);
  app.footer("`kiln help COMMAND` (or `kiln COMMAND --help`) shows a command's options.");

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
  run_cmd->add_option("--dim", dims, "bind a symbolic dim, e.g. --dim batch=4")->allow_extra_args(false);
  run_cmd->add_option("--seed", seed, "seed of the random weights and inputs");
  run_cmd->add_option("--graph", graph_name, "which graph of the module (default: the first)");

  GenerateArgs gen;
  auto* gen_cmd = app.add_subcommand("generate", "Generate text with a Llama-family model (llama.cpp's flags work)");
  gen_cmd
      ->add_option("-m,--model", gen.model,
                   "model directory (config.json, model.safetensors, tokenizer), a GGUF file, or a random-weight "
                   "shape: stories15M, stories110M, llama-1B")
      ->capture_default_str();
  gen.prompt_option = gen_cmd->add_option("-p,--prompt", gen.prompt, "the prompt text (\"\": start from BOS)");
  gen_cmd->add_option("-f,--file", gen.prompt_file, "read the prompt from FILE (-: stdin)");
  gen_cmd->add_option("--prompt-tokens", gen.prompt_tokens, "random-weight shapes: the prompt's length in ids");
  gen_cmd->add_option("-n,--max-new-tokens,--n-predict", gen.max_new_tokens,
                      "most tokens to generate (-1: until the context is full)")
      ->capture_default_str();
  add_sampling_options(gen_cmd, gen.sampling);
  gen_cmd->add_option("-r,--reverse-prompt", gen.reverse_prompts, "stop after this string (printed); repeatable")
      ->allow_extra_args(false);
  gen_cmd->add_flag("--echo", gen.echo, "print the prompt before the generated text");
  gen_cmd->add_flag("--ignore-eos", gen.ignore_eos, "do not stop at an end-of-sequence token");
  add_engine_options(gen_cmd, gen.engine);

  std::string graph_model = default_model_dir();
  int64_t graph_max_seq_len = 0;
  auto* graph_cmd =
      app.add_subcommand("graph", "Print the text generation graphs (model, sampler, greedy) of a model");
  graph_cmd->add_option("-m,--model", graph_model, "model directory, or stories15M / stories110M / llama-1B")
      ->capture_default_str();
  graph_cmd->add_option("-c,--ctx-size,--max-seq-len", graph_max_seq_len, "KV cache length of the traced graph");

  // --dir before or after the subcommand (`kiln cache list --dir D`, `kiln cache --dir D list`).
  std::string cache_dir;
  auto* cache_cmd = app.add_subcommand("cache", "List, size or clear the compile cache and the packed-weight cache");
  cache_cmd->require_subcommand(1);
  const char* cache_dir_help = "cache directory (default: KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln or ~/.cache/kiln)";
  cache_cmd->add_option("--dir", cache_dir, cache_dir_help);
  for (auto [name, help] : {std::pair{"list", "List the entries, least recently used first"},
                            std::pair{"size", "Print the total size and the limit"},
                            std::pair{"clear", "Remove every entry"}})
    cache_cmd->add_subcommand(name, help)->add_option("--dir", cache_dir, cache_dir_help);

  ServeArgs serve_args;
  auto* serve_cmd = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
  serve_cmd
      ->add_option("-m,--model", serve_args.model,
                   "model directory, or a random-weight shape (stories15M, stories110M, llama-1B: token-id prompts)")
      ->capture_default_str();
  serve_cmd->add_option("--model-name", serve_args.model_name, "the model's name in the API (default: --model's)");
  serve_cmd->add_option("--host", serve_args.host, "address to listen on")->capture_default_str();
  serve_cmd->add_option("--port", serve_args.port, "port (0: any free one)")->capture_default_str();
  add_engine_options(serve_cmd, serve_args.engine);
  serve_cmd->add_option("--max-concurrency", serve_args.max_concurrency, "requests generating at once")
      ->capture_default_str();
  serve_cmd->add_option("--max-queue", serve_args.max_queue, "requests waiting beyond those (more get 429)")
      ->capture_default_str();
  serve_cmd->add_option("--shutdown-grace", serve_args.shutdown_grace_s,
                        "seconds requests in flight may take to finish after SIGINT/SIGTERM")
      ->capture_default_str();
  serve_cmd->add_option("--chat-template", serve_args.chat_template,
                        "a Jinja chat template file, over the model's own (tokenizer_config.json, chat_template.jinja)");
  serve_cmd->add_option("--api-key", serve_args.api_key, "require 'Authorization: Bearer KEY' on /v1/*");
  serve_cmd->add_option("--tokenizer", serve_args.tokenizer,
                        "random-weight shapes: a tokenizer (a model directory or tokenizer file), for text prompts");

  ChatArgs chat_args;
  auto* chat_cmd = app.add_subcommand("chat", "Chat with a model in the terminal (its chat template)");
  chat_cmd->add_option("-m,--model", chat_args.model, "model directory or GGUF file")->capture_default_str();
  chat_cmd->add_option("--chat-template", chat_args.chat_template, "a Jinja chat template file, over the model's own");
  chat_cmd->add_option("--system", chat_args.system, "a system message");
  chat_cmd->add_option("-n,--max-tokens", chat_args.max_tokens, "longest reply (0: the rest of the context)")
      ->capture_default_str();
  add_sampling_options(chat_cmd, chat_args.sampling);
  add_engine_options(chat_cmd, chat_args.engine);

  bench::BenchCommand bench_cmd(app);

  app.add_subcommand("version", "Print kiln's version");
  std::string help_topic;
  auto* help_cmd = app.add_subcommand("help", "Print this usage, or a command's (kiln help generate)");
  help_cmd->add_option("command", help_topic, "a command");
  const std::string usage = app.help();  // before parsing: after it, help() is the chosen command's

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --version and the like
    std::fprintf(stderr, "kiln: error: %s\n", e.what());
    return 1;
  }
  try {
    if (app.get_subcommands().empty()) {
      std::cout << usage;
    } else if (app.got_subcommand("help")) {
      if (help_topic.empty()) {
        std::cout << usage;
      } else {
        const CLI::App* topic = nullptr;
        for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
          if (sub->get_name() == help_topic) topic = sub;
        if (!topic) throw ValueError(fmt::format("kiln help: no command '{}' (kiln help lists them)", help_topic));
        std::cout << topic->help();
      }
    } else if (app.got_subcommand("version")) {
      std::cout << "kiln " << kiln::version() << "\n";
    } else if (app.got_subcommand("check")) {
      graph::Module module = graph::parse_module(read_file(file));
      compiler::passes::verify(module);
      if (optimized) {
        // Compiled as a session compiles it: with its kernels, which folding and fusion consult.
        engine::InferenceSession session({DeviceRef::CPU()}, {}, {.num_threads = 1, .compile_cache = false});
        std::cout << graph::print(compiler::compile(module, {.kernels = &session.kernel_catalog()}).ir());
      } else {
        std::cout << graph::print(module);
      }
    } else if (app.got_subcommand("run")) {
      return run(file, dims, seed, graph_name);
    } else if (app.got_subcommand("generate")) {
      return generate(gen, started);
    } else if (app.got_subcommand("graph")) {
      return print_graphs(graph_model, graph_max_seq_len);
    } else if (app.got_subcommand("chat")) {
      return chat_command(chat_args);
    } else if (app.got_subcommand("serve")) {
      return serve_command(serve_args);
    } else if (app.got_subcommand("cache")) {
      return cache_command(*cache_cmd, cache_dir);
    } else if (bench_cmd.selected()) {
      return bench_cmd.run();
    }
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "kiln: error: %s\n", e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "kiln: error: unknown exception\n");
    return 1;
  }
  return 0;
}
