// `kiln bench --compare-llama-cpp PATH`: llama.cpp's llama-bench run on the same GGUF file, threads
// and token counts as kiln's run, right after it, so the two figures share the machine's state.
#include <poll.h>
#include <signal.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "bench.h"
#include "kiln/errors.h"

extern char** environ;

namespace kiln::bench {

namespace {

// Runs argv[0] with the arguments, its stdout captured (stderr, llama-bench's progress and warnings,
// thrown away unless it fails: then its tail is in the error). No shell: arguments go as they are.
std::string run_capturing_stdout(const std::vector<std::string>& argv) {
  int out_pipe[2], err_pipe[2];
  if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0)
    throw ExecutionError(fmt::format("{}: pipe failed: {}", argv[0], std::strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) posix_spawn_file_actions_addclose(&actions, fd);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (spawned != 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    throw ValueError(fmt::format("kiln bench: --compare-llama-cpp: cannot run '{}': {}", argv[0],
                                 std::strerror(spawned)));
  }
  // Both pipes drained together: a child that fills one while we block on the other would hang.
  std::string out, err;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  char buffer[65536];
  while (fds[0].fd >= 0 || fds[1].fd >= 0) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t n = read(fds[i].fd, buffer, sizeof buffer);
      if (n <= 0) {
        fds[i].fd = -1;  // poll skips negative descriptors; the pipe is closed below
        continue;
      }
      std::string& sink = i == 0 ? out : err;
      sink.append(buffer, static_cast<size_t>(n));
      if (i == 1 && err.size() > (1u << 20)) err.erase(0, err.size() - (1u << 16));  // its tail is enough
    }
    if (out.size() > (64u << 20)) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      close(out_pipe[0]);
      close(err_pipe[0]);
      throw ExecutionError(fmt::format("{}: more than 64 MiB of output; is it llama-bench?", argv[0]));
    }
  }
  close(out_pipe[0]);
  close(err_pipe[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string tail = err.size() > 2000 ? err.substr(err.size() - 2000) : err;
    throw ExecutionError(fmt::format("{} {}: {}; its last output:\n{}", argv[0], WIFEXITED(status) ? "failed" : "was killed",
                                     WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                                       : fmt::format("signal {}", WTERMSIG(status)),
                                     tail));
  }
  return out;
}

// One run's output (llama-bench -o json): its array of tests.
nlohmann::json tests_of(const std::string& text, const std::string& source) {
  nlohmann::json tests;
  try {
    tests = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw ExecutionError(fmt::format("{}: its output is not JSON ({})", source, e.what()));
  }
  if (!tests.is_array() || tests.empty())
    throw ExecutionError(fmt::format("{}: expected a JSON array of tests (llama-bench -o json)", source));
  return tests;
}

// The figures of runs' tests, together.
LlamaCppBenchResult figures_of(const nlohmann::json& tests, const std::string& source) {
  LlamaCppBenchResult r;
  bool generation_seen = false;
  for (size_t i = 0; i < tests.size(); ++i) {
    const nlohmann::json& t = tests[i];
    // Every figure checked before it is converted: a count or a speed out of range (or a float too
    // large for an integer) names the test and the key.
    auto number = [&](const char* key, double most) {
      if (!t.is_object() || !t.contains(key) || !t.at(key).is_number())
        throw ExecutionError(fmt::format("{}: test {} has no number '{}'", source, i, key));
      const double v = t.at(key).get<double>();
      if (!(v >= 0 && v <= most))
        throw ExecutionError(fmt::format("{}: test {} has '{}' {}, outside [0, {}]", source, i, key, v, most));
      return v;
    };
    constexpr double kMostTokens = 1 << 30, kMostThreads = 1 << 16;
    const double n_prompt = number("n_prompt", kMostTokens), n_gen = number("n_gen", kMostTokens),
                 tokens_per_s = number("avg_ts", std::numeric_limits<double>::max());
    if (t.contains("n_threads") && t.at("n_threads").is_number())
      r.threads = static_cast<int>(number("n_threads", kMostThreads));
    if (t.contains("build_commit") && t.at("build_commit").is_string())
      r.build_commit = t.at("build_commit").get<std::string>();
    // The context a test ran after (llama-bench before its -d option had none: 0).
    const double n_depth = t.contains("n_depth") ? number("n_depth", kMostTokens) : 0;
    // llama-bench runs each test as a prompt-only (pp) or a generation-only (tg) test; the best
    // over its load modes (mmap and not) is llama.cpp's figure. A prompt test after a context is
    // not kiln's prefill (which starts from none), so it is not taken.
    if (n_prompt > 0 && n_gen == 0 && n_depth == 0) {
      r.prompt_tokens = static_cast<int64_t>(n_prompt);
      r.prefill_tokens_per_s = std::max(r.prefill_tokens_per_s, tokens_per_s);
    } else if (n_gen > 0 && n_prompt == 0) {
      const auto depth = static_cast<int64_t>(n_depth);
      if (generation_seen && depth != r.decode_depth)
        throw ExecutionError(fmt::format("{}: generation tests after contexts of {} and {} tokens; one figure needs one",
                                         source, r.decode_depth, depth));
      r.gen_tokens = static_cast<int64_t>(n_gen);
      r.decode_depth = depth;
      generation_seen = true;
      r.decode_tokens_per_s = std::max(r.decode_tokens_per_s, tokens_per_s);
      if (t.contains("type_k") && t.at("type_k").is_string()) r.kv_type = t.at("type_k").get<std::string>();
    }
  }
  if (r.prefill_tokens_per_s <= 0 || r.decode_tokens_per_s <= 0)
    throw ExecutionError(fmt::format("{}: no prompt (pp) and generation (tg) test with a speed in its output", source));
  return r;
}

}  // namespace

LlamaCppBenchResult parse_llama_bench_json(const std::string& text, const std::string& source) {
  return figures_of(tests_of(text, source), source);
}

std::vector<std::vector<std::string>> llama_bench_runs(const LlamaCppBenchOptions& o) {
  std::vector<std::string> common = {o.llama_bench.string(), "-m", o.gguf.string(), "-t", std::to_string(o.threads),
                                     "-r", std::to_string(o.repetitions), "-mmp", "0,1"};
  // kiln's names of these two dtypes are llama-bench's.
  if (o.kv_dtype == DType::f16 || o.kv_dtype == DType::bf16) {
    const std::string type(dtype_name(o.kv_dtype));
    common.insert(common.end(), {"-ctk", type, "-ctv", type});
  }
  std::vector<std::string> prompt = common, generation = common;
  prompt.insert(prompt.end(), {"-p", std::to_string(o.prompt_tokens), "-n", "0", "-o", "json"});
  generation.insert(generation.end(), {"-p", "0", "-n", std::to_string(o.gen_tokens), "-d",
                                       std::to_string(o.prompt_tokens), "-o", "json"});
  return {prompt, generation};
}

LlamaCppBenchResult run_llama_bench(const LlamaCppBenchOptions& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_regular_file(o.llama_bench, ec) || access(o.llama_bench.c_str(), X_OK) != 0)
    throw ValueError(fmt::format("kiln bench: --compare-llama-cpp: '{}' is not an executable file (give llama.cpp's "
                                 "llama-bench)",
                                 o.llama_bench.string()));
  if (!fs::is_regular_file(o.gguf, ec))
    throw ValueError(fmt::format("kiln bench: --compare-llama-cpp: no GGUF file '{}'", o.gguf.string()));
  // Both runs' tests, read as one output.
  nlohmann::json tests = nlohmann::json::array();
  for (const std::vector<std::string>& argv : llama_bench_runs(o))
    for (nlohmann::json& test : tests_of(run_capturing_stdout(argv), o.llama_bench.string()))
      tests.push_back(std::move(test));
  LlamaCppBenchResult r = figures_of(tests, o.llama_bench.string());
  if (r.decode_depth != o.prompt_tokens)
    throw ExecutionError(fmt::format("{}: its generation test ran after {} tokens of context, not the {} asked "
                                     "(-d; llama-bench older than its depth option?)",
                                     o.llama_bench.string(), r.decode_depth, o.prompt_tokens));
  r.llama_bench = o.llama_bench.string();
  r.gguf = o.gguf.string();
  if (r.threads == 0) r.threads = o.threads;
  return r;
}

LlamaCppComparison compare(const ModelBenchResult& kiln, const LlamaCppBenchResult& llama_cpp,
                           const RoundReads& reads) {
  LlamaCppComparison c{.kiln = kiln,
                       .llama_cpp = llama_cpp,
                       .prefill_ratio = kiln.prefill_tokens_per_s / llama_cpp.prefill_tokens_per_s,
                       .decode_ratio = kiln.decode_tokens_per_s / llama_cpp.decode_tokens_per_s,
                       .reads = {reads.before.read_bytes_per_s, reads.between.read_bytes_per_s,
                                 reads.after.read_bytes_per_s},
                       .round_trips_ns = {reads.before.core_round_trip_ns, reads.between.core_round_trip_ns,
                                          reads.after.core_round_trip_ns}};
  const auto [low, high] = std::minmax({c.reads[0], c.reads[1], c.reads[2]});
  if (low <= 0) return c;
  c.llama_cpp_read_bytes_per_s = std::max(c.reads[1], c.reads[2]);
  c.llama_cpp_roofline_fraction = llama_cpp.decode_tokens_per_s /
                                  roofline_tokens_per_s(kiln.weight_bytes_per_token, c.llama_cpp_read_bytes_per_s);
  const auto [fastest, slowest] = std::minmax({c.round_trips_ns[0], c.round_trips_ns[1], c.round_trips_ns[2]});
  const bool one_topology = slowest <= 0 || (fastest > 0 && slowest <= kSamePhaseRoundTripRatio * fastest);
  c.same_phase = high <= kSamePhaseReadRatio * low && one_topology;
  return c;
}

LlamaCppRounds summarize(const std::vector<LlamaCppComparison>& rounds) {
  if (rounds.empty()) throw ValueError("kiln bench: no rounds to summarize");
  const LlamaCppComparison& first = rounds.front();
  LlamaCppRounds r{.model = first.kiln.model,
                   .dtype = first.kiln.dtype,
                   .threads = first.llama_cpp.threads,
                   .rounds = static_cast<int>(rounds.size()),
                   .prefill_ratio_min = first.prefill_ratio,
                   .prefill_ratio_max = first.prefill_ratio,
                   .decode_ratio_min = first.decode_ratio,
                   .decode_ratio_max = first.decode_ratio};
  for (const LlamaCppComparison& c : rounds) {
    r.prefill_ratio_min = std::min(r.prefill_ratio_min, c.prefill_ratio);
    r.prefill_ratio_max = std::max(r.prefill_ratio_max, c.prefill_ratio);
    r.decode_ratio_min = std::min(r.decode_ratio_min, c.decode_ratio);
    r.decode_ratio_max = std::max(r.decode_ratio_max, c.decode_ratio);
    if (!c.same_phase) continue;
    const bool first_matched = r.same_phase_rounds++ == 0;
    auto widen = [&](double& low, double& high, double ratio) {
      low = first_matched ? ratio : std::min(low, ratio);
      high = first_matched ? ratio : std::max(high, ratio);
    };
    widen(r.same_phase_prefill_ratio_min, r.same_phase_prefill_ratio_max, c.prefill_ratio);
    widen(r.same_phase_decode_ratio_min, r.same_phase_decode_ratio_max, c.decode_ratio);
  }
  return r;
}

}  // namespace kiln::bench
