// The `kiln` command as a user of llama.cpp's tools meets it: the real binary is run with the
// embedded model (found beside the binary), and its stdout, stderr and exit status are checked.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "kiln/version.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;

fs::path source_dir() { return fs::path(__FILE__).parent_path().parent_path().parent_path(); }

struct Result {
  int status = -1;  // the exit status; 128 + N when signal N ended the process
  std::string out, err;
};

// A running `kiln ARGS...`, its stdin fed from `input` and closed, stdout and stderr collected.
class Process {
 public:
  explicit Process(const std::vector<std::string>& args, const std::string& input = "") {
    int in[2], out[2], err[2];
    if (::pipe(in) != 0 || ::pipe(out) != 0 || ::pipe(err) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      for (int fd : {in[0], in[1], out[0], out[1], err[0], err[1]}) ::close(fd);
      std::vector<char*> argv{const_cast<char*>(KILN_TEST_KILN_BINARY)};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(KILN_TEST_KILN_BINARY, argv.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    ::close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
    if (!input.empty() && ::write(in[1], input.data(), input.size()) != static_cast<ssize_t>(input.size()))
      ADD_FAILURE() << "could not write the input";
    ::close(in[1]);
  }
  ~Process() {
    if (pid_ > 0 && !waited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) ::close(out_fd_);
    if (err_fd_ >= 0) ::close(err_fd_);
  }

  // Reads what is there for up to `timeout`; false once both streams are closed.
  bool pump(std::chrono::milliseconds timeout) {
    std::vector<pollfd> fds;
    for (int fd : {out_fd_, err_fd_})
      if (fd >= 0) fds.push_back({fd, POLLIN, 0});
    if (fds.empty()) return false;
    if (::poll(fds.data(), fds.size(), static_cast<int>(timeout.count())) <= 0) return true;
    for (const pollfd& p : fds) {
      if (!(p.revents & (POLLIN | POLLHUP))) continue;
      char buffer[4096];
      const ssize_t n = ::read(p.fd, buffer, sizeof buffer);
      int& fd = p.fd == out_fd_ ? out_fd_ : err_fd_;
      std::string& text = p.fd == out_fd_ ? result_.out : result_.err;
      if (n > 0) {
        text.append(buffer, static_cast<size_t>(n));
      } else {
        ::close(fd);
        fd = -1;
      }
    }
    return true;
  }
  const Result& sofar() const { return result_; }
  void signal(int sig) { ::kill(pid_, sig); }
  Result wait() {
    while (pump(std::chrono::milliseconds(1000))) {
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    waited_ = true;
    result_.status = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
    return result_;
  }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  bool waited_ = false;
  Result result_;
};

Result kiln(const std::vector<std::string>& args, const std::string& input = "") { return Process(args, input).wait(); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The greedy continuation the tests compare with: 24 tokens, EOS ignored, one thread.
const std::vector<std::string> kGreedy{"-n", "24", "--temp", "0", "--ignore-eos", "-t", "1"};
std::vector<std::string> greedy(std::vector<std::string> args) {
  std::vector<std::string> all{"generate"};
  all.insert(all.end(), args.begin(), args.end());
  all.insert(all.end(), kGreedy.begin(), kGreedy.end());
  return all;
}

int64_t stat_tokens(const std::string& err, const std::string& label) {
  std::smatch m;
  if (!std::regex_search(err, m, std::regex(label + ": (\\d+) tokens"))) return -1;
  return std::stoll(m[1]);
}

TEST(Cli, NoArgumentsAndHelpPrintTheUsage) {
  const Result bare = kiln({});
  EXPECT_EQ(bare.status, 0) << bare.err;
  EXPECT_TRUE(contains(bare.out, "generate")) << bare.out;
  EXPECT_TRUE(contains(bare.out, "kiln help COMMAND")) << bare.out;
  const Result help = kiln({"help"});
  EXPECT_EQ(help.status, 0) << help.err;
  EXPECT_EQ(help.out, bare.out);
  const Result generate = kiln({"help", "generate"});
  EXPECT_EQ(generate.status, 0) << generate.err;
  EXPECT_TRUE(contains(generate.out, "--reverse-prompt")) << generate.out;
  const Result unknown = kiln({"help", "nope"});
  EXPECT_EQ(unknown.status, 1);
  EXPECT_TRUE(contains(unknown.err, "no command 'nope'")) << unknown.err;
}

TEST(Cli, VersionFlagAndCommandPrintTheVersion) {
  const std::string expected = std::string("kiln ") + KILN_VERSION_STRING + "\n";
  const Result flag = kiln({"--version"});
  EXPECT_EQ(flag.status, 0) << flag.err;
  EXPECT_EQ(flag.out, expected);
  EXPECT_EQ(kiln({"version"}).out, expected);
}

TEST(Cli, LlamaCppShortFlagsAreAliasesOfTheLongOnes) {
  const Result lng = kiln({"generate", "--prompt", "Once upon a time", "--max-new-tokens", "12", "--temperature", "0.9",
                           "--seed", "5", "--threads", "1", "--max-seq-len", "96", "--top-k", "20"});
  const Result shrt = kiln({"generate", "-p", "Once upon a time", "-n", "12", "--temp", "0.9", "-s", "5", "-t", "1",
                            "-c", "96", "--top-k", "20"});
  ASSERT_EQ(lng.status, 0) << lng.err;
  ASSERT_EQ(shrt.status, 0) << shrt.err;
  EXPECT_GT(lng.out.size(), 1u);
  EXPECT_EQ(shrt.out, lng.out);
  // -m names the model; the default is the embedded one.
  const fs::path model = source_dir() / "models" / "kiln-tiny";
  EXPECT_EQ(kiln({"generate", "-m", model.string(), "-p", "Once upon a time", "-n", "12", "--temp", "0.9", "-s", "5",
                  "-t", "1", "-c", "96", "--top-k", "20"})
                .out,
            lng.out);
}

TEST(Cli, PromptFromAFileOrStdin) {
  const std::string prompt = "The meaning of life is";
  const Result direct = kiln(greedy({"-p", prompt}));
  ASSERT_EQ(direct.status, 0) << direct.err;
  const fs::path file = fs::temp_directory_path() / ("kiln_cli_prompt_" + std::to_string(::getpid()) + ".txt");
  std::ofstream(file) << prompt;
  const Result from_file = kiln(greedy({"-f", file.string()}));
  fs::remove(file);
  EXPECT_EQ(from_file.status, 0) << from_file.err;
  EXPECT_EQ(from_file.out, direct.out);
  const Result from_stdin = kiln(greedy({"-f", "-"}), prompt);
  EXPECT_EQ(from_stdin.status, 0) << from_stdin.err;
  EXPECT_EQ(from_stdin.out, direct.out);
  const Result missing = kiln({"generate", "-f", "/nonexistent/prompt.txt"});
  EXPECT_EQ(missing.status, 1);
  EXPECT_TRUE(contains(missing.err, "-f/--file '/nonexistent/prompt.txt': cannot open it")) << missing.err;
}

TEST(Cli, ARandomSeedIsPrintedAndAGivenSeedRepeatsTheRun) {
  const std::vector<std::string> args{"generate", "-p", "Love is", "-n", "16", "--temp", "1", "-t", "1"};
  const Result first = kiln(args);
  const Result second = kiln(args);
  ASSERT_EQ(first.status, 0) << first.err;
  std::smatch m1, m2;
  ASSERT_TRUE(std::regex_search(first.err, m1, std::regex("kiln: seed (\\d+)"))) << first.err;
  ASSERT_TRUE(std::regex_search(second.err, m2, std::regex("kiln: seed (\\d+)"))) << second.err;
  EXPECT_NE(m1[1], m2[1]);  // two draws of 64 bits
  std::vector<std::string> repeat = args;
  repeat.insert(repeat.end(), {"--seed", m1[1].str()});
  const Result again = kiln(repeat);
  EXPECT_EQ(again.out, first.out);
  EXPECT_FALSE(contains(again.err, "kiln: seed")) << again.err;  // a given seed is not news
}

TEST(Cli, MinusOneGeneratesUntilTheContextIsFull) {
  const Result r = kiln({"generate", "-p", "Once upon a time", "-n", "-1", "-c", "32", "--ignore-eos", "--temp", "0",
                         "-t", "1"});
  ASSERT_EQ(r.status, 0) << r.err;
  const int64_t prompt = stat_tokens(r.err, "prompt"), generated = stat_tokens(r.err, "generated");
  EXPECT_GT(prompt, 0) << r.err;
  EXPECT_EQ(prompt + generated, 32) << r.err;
  EXPECT_TRUE(contains(r.err, "finish: length")) << r.err;
}

TEST(Cli, TheStatisticsAddLoadAndTotalTimes) {
  const Result r = kiln(greedy({"-p", "Once upon a time"}));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(std::regex_search(r.err, std::regex("\nload: [0-9.]+ s\n"))) << r.err;
  EXPECT_TRUE(std::regex_search(r.err, std::regex("\ntotal: [0-9.]+ s\n"))) << r.err;
  EXPECT_EQ(stat_tokens(r.err, "generated"), 24) << r.err;
  // The first token comes after the load, and the process holds at least its embedded model's
  // weights (about 4 MiB of f32) and far less than a gigabyte.
  std::smatch first, load, rss;
  ASSERT_TRUE(std::regex_search(r.err, first, std::regex("\nfirst token: ([0-9.]+) s after start"))) << r.err;
  ASSERT_TRUE(std::regex_search(r.err, load, std::regex("\nload: ([0-9.]+) s\n"))) << r.err;
  EXPECT_GE(std::stod(first[1]), std::stod(load[1])) << r.err;
  ASSERT_TRUE(std::regex_search(r.err, rss, std::regex("\npeak memory: ([0-9.]+) MiB resident\n"))) << r.err;
  EXPECT_GT(std::stod(rss[1]), 4.0) << r.err;
  EXPECT_LT(std::stod(rss[1]), 1024.0) << r.err;
}

// Each bad value is refused before the model loads (the missing model is never reached), with the
// flag and what it accepts.
TEST(Cli, BadOptionsAreRefusedBeforeLoadingNamingTheFlagAndItsRange) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--top-p", "1.5"}, "--top-p must be in (0, 1], got 1.5"},
      {{"--top-p", "0"}, "--top-p must be in (0, 1], got 0"},
      {{"--temp", "-1"}, "--temp must be a finite number >= 0 (0: greedy), got -1"},
      {{"--top-k", "999"}, "--top-k must be in [0, 256]"},
      {{"--min-p", "2"}, "--min-p must be in [0, 1], got 2"},
      {{"--repeat-penalty", "0"}, "--repeat-penalty must be a finite number > 0"},
      {{"-n", "-2"}, "-n/--max-new-tokens must be -1 (until the context is full) or >= 0, got -2"},
      {{"-t", "-1"}, "-t/--threads must be >= 0"},
      {{"-c", "-5"}, "-c/--ctx-size must be >= 0"},
      {{"--kv-dtype", "f8"}, "--kv-dtype must be f32, bf16 or f16, got 'f8'"},
      {{"--kv-cache-gb", "-1"}, "--kv-cache-gb must be in [0, 1e6] GiB"},
      {{"--dtype", "q9"}, "--dtype: unknown weight format 'q9'"},
      {{"--stop", ""}, "--stop: a stop string is empty"},
      {{"-r", ""}, "-r/--reverse-prompt: the string is empty"},
      {{"-f", "/dev/null"}, "give the prompt once"},
      {{"-n", "abc"}, "abc"},
  };
  for (const auto& [flags, expected] : cases) {
    std::vector<std::string> args{"generate", "-m", "/nonexistent/model", "-p", "x"};
    args.insert(args.end(), flags.begin(), flags.end());
    const Result r = kiln(args);
    EXPECT_EQ(r.status, 1) << flags[0];
    EXPECT_TRUE(contains(r.err, expected)) << "flags " << flags[0] << ": " << r.err;
    EXPECT_FALSE(contains(r.err, "loading")) << r.err;
    EXPECT_FALSE(contains(r.err, "/nonexistent/model")) << r.err;
  }
  const Result chat = kiln({"chat", "-m", "/nonexistent/model", "--top-p", "2"});
  EXPECT_EQ(chat.status, 1);
  EXPECT_TRUE(contains(chat.err, "--top-p must be in (0, 1], got 2")) << chat.err;
  const Result none = kiln({"generate"});
  EXPECT_EQ(none.status, 1);
  EXPECT_TRUE(contains(none.err, "no prompt: give -p/--prompt TEXT or -f/--file FILE")) << none.err;
}

TEST(Cli, AnEmptyPromptStartsFromBos) {
  const Result r = kiln(greedy({"--prompt", ""}));
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(stat_tokens(r.err, "prompt"), 1) << r.err;
  EXPECT_GT(r.out.size(), 1u);
}

TEST(Cli, AMissingModelIsCalledMissing) {
  const Result r = kiln({"generate", "-m", "/nonexistent/model-Q4_K_M.gguf", "-p", "x"});
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.err, "--model '/nonexistent/model-Q4_K_M.gguf': no such file or directory")) << r.err;
  EXPECT_FALSE(contains(r.err, "directory '/nonexistent")) << r.err;
  // A file that is not GGUF is not a directory that "does not exist" either.
  const Result file = kiln({"generate", "-m", (source_dir() / "README.md").string(), "-p", "x"});
  EXPECT_EQ(file.status, 1);
  EXPECT_TRUE(contains(file.err, "is a file but not a GGUF file")) << file.err;
}

TEST(Cli, RunSaysWhichDimIsNotASize) {
  const std::string graph = (source_dir() / "examples" / "graphs" / "attention.kiln").string();
  const Result r = kiln({"run", graph, "--dim", "seq=abc"});
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.err, "--dim 'seq=abc': the value 'abc' is not a size (an integer >= 0)")) << r.err;
  EXPECT_FALSE(contains(r.err, "stoll")) << r.err;
  EXPECT_TRUE(contains(kiln({"run", graph, "--dim", "seq"}).err, "expected name=value"));
  EXPECT_EQ(kiln({"run", graph, "--dim", "seq=5"}).status, 0);
}

TEST(Cli, CacheTakesDirAfterItsSubcommandAsTheDocsWriteIt) {
  const fs::path dir = fs::temp_directory_path() / ("kiln_cli_cache_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const Result list = kiln({"cache", "list", "--dir", dir.string()});
  EXPECT_EQ(list.status, 0) << list.err;
  const Result after = kiln({"cache", "size", "--dir", dir.string()});
  EXPECT_EQ(after.status, 0) << after.err;
  EXPECT_EQ(after.out.rfind(dir.string() + ": 0 compiled models", 0), 0u) << after.out;
  EXPECT_TRUE(contains(after.out, "\n" + (dir / "weights").string() + ": 0 packed weights")) << after.out;
  EXPECT_EQ(kiln({"cache", "--dir", dir.string(), "size"}).out, after.out);
  fs::remove_all(dir);
}

TEST(Cli, StopStringsAreHiddenAndReversePromptsShown) {
  const std::string prompt = "Once upon a time";
  const Result plain = kiln(greedy({"-p", prompt}));
  ASSERT_EQ(plain.status, 0) << plain.err;
  const std::string text = plain.out.substr(0, plain.out.size() - 1);  // without the final newline
  ASSERT_GT(text.size(), 12u) << text;
  const std::string stop = text.substr(8, 3);
  const size_t at = text.find(stop);
  const Result stopped = kiln(greedy({"-p", prompt, "--stop", stop}));
  EXPECT_EQ(stopped.status, 0) << stopped.err;
  EXPECT_EQ(stopped.out, text.substr(0, at) + "\n");
  EXPECT_TRUE(contains(stopped.err, "finish: stop")) << stopped.err;
  const Result reversed = kiln(greedy({"-p", prompt, "-r", stop}));
  EXPECT_EQ(reversed.out, text.substr(0, at + stop.size()) + "\n");
  const Result echoed = kiln(greedy({"-p", prompt, "--echo"}));
  EXPECT_EQ(echoed.out, prompt + plain.out);
}

TEST(Cli, ChatTakesTheSameFlags) {
  const Result r = kiln({"chat", "-n", "6", "--temp", "0", "-t", "1", "-c", "128", "--system", "Be brief."},
                        "Hello there\n");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_GT(r.out.size(), 1u);
  EXPECT_TRUE(contains(r.err, "kiln: seed")) << r.err;
}

// Ctrl-C: the token being made is finished and printed, then a newline and the statistics, and the
// exit status is 130. A random-weight shape with the whole context to fill keeps it generating.
TEST(Cli, SigintEndsAfterTheCurrentTokenWithTheStatisticsAndStatus130) {
  Process p({"generate", "-m", "stories15M", "--prompt-tokens", "4", "-n", "-1", "--ignore-eos", "-t", "1",
             "--temp", "0"});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  // Wait for a few generated ids (each printed with a space after it).
  while (std::count(p.sofar().out.begin(), p.sofar().out.end(), ' ') < 4 &&
         std::chrono::steady_clock::now() < deadline)
    ASSERT_TRUE(p.pump(std::chrono::milliseconds(100))) << p.sofar().err;
  ASSERT_LT(std::chrono::steady_clock::now(), deadline) << p.sofar().err;
  p.signal(SIGINT);
  const Result r = p.wait();
  EXPECT_EQ(r.status, 130) << r.err;
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.back(), '\n');
  EXPECT_TRUE(contains(r.err, "finish: cancelled (interrupted)")) << r.err;
  EXPECT_TRUE(contains(r.err, "total: ")) << r.err;
  // Every token the statistics count was printed: no token is cut off.
  const int64_t printed = std::count(r.out.begin(), r.out.end(), ' ');
  EXPECT_EQ(stat_tokens(r.err, "generated"), printed) << r.err;
  EXPECT_LT(printed, 2000) << "it ran to the end of the context: the signal came too late";
}

// --rounds with --compare-llama-cpp: kiln, then llama-bench (a stand-in printing a faster decode on
// each call), round after round, then the range of the rounds' ratios.
TEST(Cli, BenchRoundsAlternateKilnAndLlamaBenchAndGiveTheRatiosRange) {
  kiln::testing::TempDir dir("bench_rounds");
  fs::create_directories(dir.path());
  const fs::path calls = dir.path() / "calls", fake = dir.path() / "llama-bench", gguf = dir.path() / "m.gguf";
  // Each round runs it twice: the prompt test (-n 0) prints a prefill of 100 tok/s; generation call n
  // (counted in `calls`) a decode of 10 n tok/s after the prompt's 4 tokens.
  std::ofstream(fake) << "#!/bin/sh\n"
                      << R"(case " $* " in *" -n 0 "*)
  echo '[{"build_commit": "x", "n_threads": 1, "n_prompt": 4, "n_gen": 0, "n_depth": 0, "avg_ts": 100}]'; exit 0;;
esac
)" << "echo call >> '" << calls.string() << "'\nn=$(wc -l < '" << calls.string() << "')\n"
                      << R"(echo "[{\"build_commit\": \"x\", \"n_threads\": 1, \"n_prompt\": 0, \"n_gen\": 4, \"n_depth\": 4, \"avg_ts\": $((10 * n))}]"
)";
  fs::permissions(fake, fs::perms::owner_all);
  std::ofstream(gguf) << "GGUF";
  const Result r = kiln({"bench", "--model", "stories15M", "--threads", "1", "--prompt-tokens", "4", "--gen-tokens", "4",
                         "--repetitions", "1", "--rounds", "2", "--compare-llama-cpp", fake.string(),
                         "--llama-cpp-model", gguf.string(), "--json"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::vector<nlohmann::json> lines;
  std::istringstream out(r.out);
  for (std::string line; std::getline(out, line);) lines.push_back(nlohmann::json::parse(line));
  std::vector<std::string> kinds;
  for (const auto& j : lines) kinds.push_back(j.at("kind"));
  EXPECT_EQ(kinds, (std::vector<std::string>{"model", "llama_cpp", "model", "llama_cpp", "llama_cpp_rounds"}));
  ASSERT_EQ(lines.size(), 5u);
  // Each round's llama.cpp figure is its own call's (10, then 20 tok/s), set against that round's kiln run.
  EXPECT_EQ(lines[1].at("decode_tokens_per_s"), 10.0);
  EXPECT_EQ(lines[3].at("decode_tokens_per_s"), 20.0);
  for (size_t i : {1u, 3u})
    EXPECT_DOUBLE_EQ(lines[i].at("decode_ratio").get<double>(),
                     lines[i - 1].at("decode_tokens_per_s").get<double>() / lines[i].at("decode_tokens_per_s").get<double>());
  const double first = lines[1].at("decode_ratio"), second = lines[3].at("decode_ratio");
  const nlohmann::json& range = lines[4];
  EXPECT_EQ(range.at("rounds"), 2);
  EXPECT_DOUBLE_EQ(range.at("decode_ratio_min").get<double>(), std::min(first, second));
  EXPECT_DOUBLE_EQ(range.at("decode_ratio_max").get<double>(), std::max(first, second));
  EXPECT_DOUBLE_EQ(range.at("prefill_ratio_min").get<double>(),
                   std::min(lines[1].at("prefill_ratio").get<double>(), lines[3].at("prefill_ratio").get<double>()));

  const Result zero = kiln({"bench", "--model", "stories15M", "--rounds", "0"});
  EXPECT_EQ(zero.status, 1);
  EXPECT_TRUE(contains(zero.err, "--rounds must be >= 1, got 0")) << zero.err;
}

}  // namespace
