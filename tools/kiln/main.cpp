// The `kiln` command.
//   kiln check FILE [--optimized]           parse and verify a graph text file, print it back
//   kiln run FILE [--dim name=N ...] [--seed S] [--graph NAME]
//                                           compile it, bind seeded random weights and inputs, run it,
//                                           print the outputs
//   kiln generate [--model DIR|NAME] --prompt TEXT [--max-new-tokens N --temperature T --top-k K
//                 --top-p P --seed S --max-seq-len L --threads N --ignore-eos --dtype f32|f16|bf16|q8_0|q4_0|q4_k|q5_k|q6_k]
//                                           generate text (stdout: the new text only; stderr: progress
//                                           and stats). NAME: a random-weight shape (stories15M,
//                                           stories110M) run on --prompt-tokens N ids, printing ids
//   kiln graph [--model DIR|NAME]           print the text generation graphs (model, sampler, greedy)
//   kiln cache list|size|clear [--dir DIR]  the compile cache (default: KILN_CACHE_DIR, else
//                                           $XDG_CACHE_HOME/kiln or ~/.cache/kiln): list its entries
//                                           (least recently used first), print its size, empty it
//   kiln bench [--model NAME|DIR ...] | gemm | bandwidth
//                                           tokens/s against the bandwidth roofline, GEMM against
//                                           oneDNN, read bandwidth (tools/kiln/bench.h)
//   kiln version
#include <fmt/format.h>
#include <kiln/engine/compile_cache.h>
#include <kiln/kiln.h>
#include <kiln/version.h>
#include <kiln/pipelines/gguf_model.h>
#include <kiln/pipelines/hf_config.h>
#include <kiln/pipelines/text_generation.h>
#include <kiln/pipelines/chat_template.h>
#include <kiln/serve/server.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include "bench.h"
#include "chat.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <thread>

#ifndef KILN_DEFAULT_MODEL_DIR
#define KILN_DEFAULT_MODEL_DIR "models/kiln-tiny"
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

// ---- generate / graph ----------------------------------------------------------------------------

struct GenerateArgs {
  std::string model = KILN_DEFAULT_MODEL_DIR;
  std::string prompt;
  int64_t prompt_tokens = 0;
  pipelines::GenerationOptions options{.max_new_tokens = 128, .temperature = 0.8, .top_k = 40, .top_p = 0.95};
  bool ignore_eos = false;
  int64_t max_seq_len = 0;
  int threads = 0;
  std::string dtype;  // the weight format (docs/quantization.md); empty: the checkpoint's
  double kv_cache_gb = 0;     // 0: the engine's default
  std::string kv_dtype = "f32";
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

// --dtype: the weight format, or (not given) the checkpoint's own.
std::optional<nn::WeightFormat> weight_format_option(const std::string& name) {
  if (name.empty()) return std::nullopt;
  return nn::parse_weight_format(name);
}

// --kv-dtype: how the paged KV cache stores keys and values.
DType parse_kv_dtype(const std::string& name) {
  if (name == "f32") return DType::f32;
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  throw ValueError(fmt::format("--kv-dtype must be f32, bf16 or f16, got '{}'", name));
}

// --kv-cache-gb: the KV cache's byte budget (0: the engine's default).
int64_t kv_cache_bytes(double gb) {
  if (!(gb >= 0) || gb > 1e6) throw ValueError(fmt::format("--kv-cache-gb must be >= 0, got {}", gb));
  return static_cast<int64_t>(gb * double(int64_t{1} << 30));
}

pipelines::TextGenerationPipeline load_pipeline(const GenerateArgs& args) {
  LoadProgress progress;
  pipelines::PipelineOptions options{.max_seq_len = args.max_seq_len,
                                     .num_threads = args.threads,
                                     .weight_format = weight_format_option(args.dtype)};
  options.kv_cache_dtype = parse_kv_dtype(args.kv_dtype);
  options.kv_cache_bytes = kv_cache_bytes(args.kv_cache_gb);
  options.on_stage = [&](std::string_view stage, int index, int total) {
    progress.stage(stage, index, total);
  };
  if (auto config = pipelines::named_config(args.model)) {
    progress.stage("random weights", 0, 2);
    WeightsRegistry weights = pipelines::random_weights(*config, args.options.seed);
    progress.stage("graphs", 1, 2);
    auto pipe = pipelines::TextGenerationPipeline::from_config(*config, weights, nullptr, {}, options);
    progress.done();
    return pipe;
  }
  auto pipe = pipelines::TextGenerationPipeline::from_dir(args.model, options);
  progress.done();
  return pipe;
}

void print_stats(const pipelines::GenerationStats& s) {
  std::fprintf(stderr, "\nprompt: %lld tokens, prefill %.3f s (%.1f tokens/s)\n",
               static_cast<long long>(s.prompt_tokens), s.prefill_seconds, s.prefill_tokens_per_s);
  std::fprintf(stderr, "generated: %lld tokens, decode %.3f s (%.1f tokens/s)\n",
               static_cast<long long>(s.generated_tokens), s.decode_seconds, s.decode_tokens_per_s);
  std::fprintf(stderr, "finish: %s\n", pipelines::finish_reason_name(s.finish_reason));
}

int generate(GenerateArgs args) {
  args.options.stop_at_eos = !args.ignore_eos;
  const bool named = pipelines::named_config(args.model).has_value();
  if (named && args.prompt_tokens <= 0)
    throw ValueError(
        fmt::format("model '{}' has random weights and no tokenizer: give --prompt-tokens N", args.model));
  if (!named && args.prompt_tokens > 0)
    throw ValueError(
        "--prompt-tokens is for the random-weight shapes (stories15M, stories110M, llama-1B); give --prompt");
  if (!named && args.prompt.empty()) throw ValueError("--prompt is required");
  pipelines::check_generation_options(args.options);  // before the model loads

  auto pipe = load_pipeline(args);
  pipelines::GenerationResult result;
  if (named) {
    // A fixed pseudo-random prompt (BOS = 1 first, as Llama 2), printed as ids like the output.
    std::mt19937_64 rng(args.options.seed);
    std::vector<int64_t> prompt{1};
    while (static_cast<int64_t>(prompt.size()) < args.prompt_tokens)
      prompt.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(pipe.config().vocab_size)));
    result = pipe.generate_ids(prompt, args.options, [](int64_t id) {
      std::fprintf(stdout, "%lld ", static_cast<long long>(id));
      std::fflush(stdout);
    });
    std::fputc('\n', stdout);
  } else {
    result = pipe.generate(args.prompt, args.options, [](std::string_view piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    });
    std::fputc('\n', stdout);
  }
  std::fflush(stdout);
  print_stats(result.stats);
  return 0;
}

// ---- serve --------------------------------------------------------------------------------------

struct ServeArgs {
  std::string model = KILN_DEFAULT_MODEL_DIR;
  std::string model_name;  // default: the directory's or shape's name
  std::string dtype;  // empty: the checkpoint's
  std::string host = "127.0.0.1";
  int port = 8000;
  int threads = 0;
  int64_t max_seq_len = 0;
  double kv_cache_gb = 0;
  std::string kv_dtype = "f32";
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

  pipelines::EngineOptions options{.max_seq_len = args.max_seq_len,
                                   .num_threads = args.threads,
                                   .weight_format = weight_format_option(args.dtype)};
  options.kv_cache_dtype = parse_kv_dtype(args.kv_dtype);
  options.kv_cache_bytes = kv_cache_bytes(args.kv_cache_gb);
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
  std::string model = KILN_DEFAULT_MODEL_DIR;
  std::string dtype;  // empty: the checkpoint's
  int threads = 0;
  int64_t max_seq_len = 0;
  std::string chat_template;
  chat::ChatOptions options;
};

int chat_command(ChatArgs args) {
  pipelines::check_sampling(args.options.sampling);  // before the model loads
  if (pipelines::named_config(args.model))
    throw ValueError(fmt::format("kiln chat needs a model directory with a tokenizer; '{}' is a random-weight shape",
                                 args.model));
  LoadProgress progress;
  pipelines::EngineOptions options{.max_seq_len = args.max_seq_len,
                                   .num_threads = args.threads,
                                   .weight_format = weight_format_option(args.dtype)};
  options.max_num_seqs = 1;
  options.on_stage = [&](std::string_view stage, int index, int total) { progress.stage(stage, index, total); };
  auto engine = pipelines::GenerationEngine::from_dir(args.model, options);
  progress.done();
  auto chat_template = load_chat_template(args.chat_template, args.model, engine->tokenizer());
  if (!chat_template)
    throw ValueError(fmt::format("'{}' has no chat template (tokenizer_config.json's chat_template or "
                                 "chat_template.jinja): give --chat-template FILE",
                                 args.model));
  args.options.prompt_marks = isatty(fileno(stdin)) != 0;
  if (args.options.prompt_marks) std::fprintf(stderr, "kiln chat: /reset forgets the conversation, /exit ends it\n");
  chat::run_chat(*engine, *chat_template, args.options, std::cin, std::cout, std::cerr);
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
  engine::CompileCache cache(dir);
  if (cmd.got_subcommand("list")) {
    for (const engine::CacheEntry& e : cache.entries()) {
      auto age = std::chrono::duration_cast<std::chrono::seconds>(std::filesystem::file_time_type::clock::now() -
                                                                  e.last_used);
      std::cout << fmt::format("{}  {:>10} bytes  used {}s ago\n", e.key, e.bytes, age.count());
    }
  } else if (cmd.got_subcommand("size")) {
    std::cout << fmt::format("{}: {} entries, {} bytes (limit {} bytes)\n", cache.dir().string(),
                             cache.entries().size(), cache.size_bytes(), cache.max_bytes());
  } else if (cmd.got_subcommand("clear")) {
    std::cout << fmt::format("{}: removed {} entries\n", cache.dir().string(), cache.clear());
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

  GenerateArgs gen;
  auto* gen_cmd = app.add_subcommand("generate", "Generate text with a Llama-family model");
  gen_cmd
      ->add_option("--model", gen.model,
                   "model directory (config.json, model.safetensors, tokenizer), or a random-weight shape: "
                   "stories15M, stories110M")
      ->capture_default_str();
  gen_cmd->add_option("--prompt", gen.prompt, "the prompt text (not repeated on stdout)");
  gen_cmd->add_option("--prompt-tokens", gen.prompt_tokens,
                      "random-weight shapes: the prompt's length in ids");
  gen_cmd->add_option("--max-new-tokens", gen.options.max_new_tokens, "most tokens to generate")
      ->capture_default_str();
  gen_cmd->add_option("--temperature", gen.options.temperature, "0: greedy (argmax)")->capture_default_str();
  gen_cmd->add_option("--top-k", gen.options.top_k, "keep the k most likely tokens (0: off)")
      ->capture_default_str();
  gen_cmd->add_option("--top-p", gen.options.top_p, "nucleus mass (1: off)")->capture_default_str();
  gen_cmd->add_option("--seed", gen.options.seed, "seed of the sampler's random numbers")
      ->capture_default_str();
  gen_cmd->add_option("--max-seq-len", gen.max_seq_len,
                      "KV cache length (default: min(max_position_embeddings, 2048))");
  gen_cmd->add_option("--threads", gen.threads, "engine threads (default: one per core)");
  gen_cmd->add_option("--dtype", gen.dtype, "weight format: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k (converted at load; default: a GGUF file's own, else f32)");
  gen_cmd->add_option("--kv-cache-gb", gen.kv_cache_gb,
                      "KV cache budget in GiB (default: what 64 sequences of max-seq-len need, at most a quarter "
                      "of the free memory)");
  gen_cmd->add_option("--kv-dtype", gen.kv_dtype, "KV cache dtype: f32, bf16 or f16")->capture_default_str();
  gen_cmd->add_flag("--ignore-eos", gen.ignore_eos, "do not stop at an end-of-sequence token");

  std::string graph_model = KILN_DEFAULT_MODEL_DIR;
  int64_t graph_max_seq_len = 0;
  auto* graph_cmd =
      app.add_subcommand("graph", "Print the text generation graphs (model, sampler, greedy) of a model");
  graph_cmd->add_option("--model", graph_model, "model directory, or stories15M / stories110M / llama-1B")
      ->capture_default_str();
  graph_cmd->add_option("--max-seq-len", graph_max_seq_len, "KV cache length of the traced graph");

  std::string cache_dir;
  auto* cache_cmd = app.add_subcommand("cache", "List, size or clear the compile cache");
  cache_cmd->require_subcommand(1);
  cache_cmd->add_option("--dir", cache_dir, "cache directory (default: KILN_CACHE_DIR or ~/.cache/kiln)");
  cache_cmd->add_subcommand("list", "List the entries, least recently used first");
  cache_cmd->add_subcommand("size", "Print the total size and the limit");
  cache_cmd->add_subcommand("clear", "Remove every entry");

  ServeArgs serve_args;
  auto* serve_cmd = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
  serve_cmd
      ->add_option("--model", serve_args.model,
                   "model directory, or a random-weight shape (stories15M, stories110M, llama-1B: token-id prompts)")
      ->capture_default_str();
  serve_cmd->add_option("--model-name", serve_args.model_name, "the model's name in the API (default: --model's)");
  serve_cmd->add_option("--dtype", serve_args.dtype, "weight format: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k (default: a GGUF file's own, else f32)");
  serve_cmd->add_option("--host", serve_args.host, "address to listen on")->capture_default_str();
  serve_cmd->add_option("--port", serve_args.port, "port (0: any free one)")->capture_default_str();
  serve_cmd->add_option("--threads", serve_args.threads, "engine threads (default: one per core)");
  serve_cmd->add_option("--max-seq-len", serve_args.max_seq_len, "longest sequence, prompt + generated");
  serve_cmd->add_option("--kv-cache-gb", serve_args.kv_cache_gb, "KV cache budget in GiB");
  serve_cmd->add_option("--kv-dtype", serve_args.kv_dtype, "KV cache dtype: f32, bf16 or f16")->capture_default_str();
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
  chat_args.options.sampling.max_new_tokens = 0;
  chat_args.options.sampling.temperature = 0.8;
  chat_args.options.sampling.top_k = 40;
  chat_args.options.sampling.top_p = 0.95;
  auto* chat_cmd = app.add_subcommand("chat", "Chat with a model in the terminal (its chat template)");
  chat_cmd->add_option("--model", chat_args.model, "model directory")->capture_default_str();
  chat_cmd->add_option("--chat-template", chat_args.chat_template, "a Jinja chat template file, over the model's own");
  chat_cmd->add_option("--system", chat_args.options.system, "a system message");
  chat_cmd->add_option("--max-tokens", chat_args.options.sampling.max_new_tokens,
                       "longest reply (0: the rest of the context)")
      ->capture_default_str();
  chat_cmd->add_option("--temperature", chat_args.options.sampling.temperature, "0: greedy")->capture_default_str();
  chat_cmd->add_option("--top-k", chat_args.options.sampling.top_k, "0: off")->capture_default_str();
  chat_cmd->add_option("--top-p", chat_args.options.sampling.top_p, "1: off")->capture_default_str();
  chat_cmd->add_option("--seed", chat_args.options.sampling.seed, "sampling seed")->capture_default_str();
  chat_cmd->add_option("--dtype", chat_args.dtype, "weight format: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k (default: a GGUF file's own, else f32)");
  chat_cmd->add_option("--threads", chat_args.threads, "threads (default: one per core)");
  chat_cmd->add_option("--max-seq-len", chat_args.max_seq_len, "the context: conversation + reply");

  bench::BenchCommand bench_cmd(app);

  app.add_subcommand("version", "Print kiln's version");

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
    if (app.got_subcommand("version")) {
      std::cout << "kiln " << KILN_VERSION_STRING << "\n";
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
      return generate(gen);
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
