// What `kiln bench` prints: one JSON object per result (--json), or table rows for people.
#include <fmt/format.h>

#include "bench.h"

namespace kiln::bench {

nlohmann::json to_json(const ModelBenchResult& r) {
  nlohmann::json json = {{"kind", "model"},
                         {"model", r.model},
                         {"dtype", r.dtype},
                         {"kv_dtype", r.kv_dtype},
                         {"threads", r.threads},
                         {"params", r.parameters},
                         {"weight_bytes_per_token", r.weight_bytes_per_token},
                         {"prompt_tokens", r.prompt_tokens},
                         {"gen_tokens", r.gen_tokens},
                         {"repetitions", r.repetitions},
                         {"prefill_tokens_per_s", r.prefill_tokens_per_s},
                         {"decode_tokens_per_s", r.decode_tokens_per_s},
                         {"read_gb_per_s", r.read_bytes_per_s * 1e-9},
                         {"roofline_tokens_per_s", r.roofline_tokens_per_s},
                         {"roofline_fraction", r.roofline_fraction}};
  if (!r.decode_profile.empty()) {
    nlohmann::json profile = nlohmann::json::array();
    for (const DecodeProfileEntry& e : r.decode_profile)
      profile.push_back({{"graph", e.graph},
                         {"op", e.op},
                         {"launches_per_token", e.launches_per_token},
                         {"seconds_per_token", e.seconds_per_token},
                         {"fraction", e.fraction},
                         {"weight_bytes_per_launch", e.weight_bytes_per_launch},
                         {"weight_gb_per_s", e.weight_bytes_per_s() * 1e-9}});
    json["decode_profile"] = std::move(profile);
  }
  if (r.paired)
    json["paired_roofline"] = {{"steps", r.paired->steps},
                               {"read_gb_per_s_median", r.paired->read_bytes_per_s_median * 1e-9},
                               {"fraction_median", r.paired->fraction_median},
                               {"fraction_p10", r.paired->fraction_p10},
                               {"fraction_p90", r.paired->fraction_p90}};
  return json;
}

nlohmann::json to_json(const GemmBenchResult& r) {
  return {
      {"kind", "gemm"},
      {"m", r.m},
      {"n", r.n},
      {"k", r.k},
      {"dtype", dtype_name(r.dtype)},
      {"weights", r.weights ? nlohmann::json(std::string(nn::weight_format_name(*r.weights))) : nlohmann::json(nullptr)},
      {"threads", r.threads},
      {"repetitions", r.repetitions},
      {"seconds", r.seconds},
      {"gflops", r.gflops},
      {"weight_bytes", r.weight_bytes},
      {"weight_gb_per_s", r.weight_gb_per_s},
      {"onednn_gflops", r.onednn_gflops ? nlohmann::json(*r.onednn_gflops) : nlohmann::json(nullptr)},
      {"onednn_note", r.onednn_note},
      {"peak_gflops", r.peak_gflops},
      {"peak_fraction", r.gflops / r.peak_gflops},
      {"onednn_peak_fraction",
       r.onednn_gflops ? nlohmann::json(*r.onednn_gflops / r.peak_gflops) : nlohmann::json(nullptr)},
      {"bf16_dot_peak_gflops",
       r.bf16_dot_peak_gflops ? nlohmann::json(*r.bf16_dot_peak_gflops) : nlohmann::json(nullptr)},
      {"bf16_dot_peak_fraction", r.bf16_dot_peak_gflops ? nlohmann::json(r.gflops / *r.bf16_dot_peak_gflops)
                                                        : nlohmann::json(nullptr)}};
}

nlohmann::json to_json(const BandwidthResult& r) {
  nlohmann::json by_streams = nlohmann::json::object();
  for (const auto& [streams, rate] : r.read_bytes_per_s_by_streams) by_streams[std::to_string(streams)] = rate * 1e-9;
  return {{"kind", "bandwidth"},
          {"threads", r.threads},
          {"buffer_bytes", r.buffer_bytes},
          {"streams_per_thread", r.streams_per_thread},
          {"passes", r.passes},
          {"read_gb_per_s", r.read_bytes_per_s * 1e-9},
          {"read_gb_per_s_by_streams", by_streams},
          {"core_round_trip_ns", r.core_round_trip_ns}};
}

std::string model_table_header(int64_t prompt_tokens, int64_t gen_tokens) {
  return fmt::format("{:<14} {:<9} {:>7} {:>9} {:>12} {:>12} {:>12} {:>10} {:>14} {:>9}", "model", "dtype",
                     "threads", "params", "MB/token", fmt::format("pp{} tok/s", prompt_tokens),
                     fmt::format("tg{} tok/s", gen_tokens), "read GB/s", "roofline tok/s", "roofline");
}

std::string table_row(const ModelBenchResult& r) {
  std::string row = fmt::format(
      "{:<14} {:<9} {:>7} {:>8.1f}M {:>12.1f} {:>12.1f} {:>12.1f} {:>10.1f} {:>14.1f} {:>8.1f}%", r.model,
      r.dtype, r.threads, static_cast<double>(r.parameters) * 1e-6,
      r.weight_bytes_per_token * 1e-6, r.prefill_tokens_per_s, r.decode_tokens_per_s,
      r.read_bytes_per_s * 1e-9, r.roofline_tokens_per_s, 100.0 * r.roofline_fraction);
  if (r.paired)
    row += fmt::format("\n  each decode step against a read right after it: {:.1f}% of its bandwidth (p10-p90 "
                       "{:.1f}-{:.1f}%, {} steps; the reads {:.1f} GB/s median)",
                       100.0 * r.paired->fraction_median, 100.0 * r.paired->fraction_p10,
                       100.0 * r.paired->fraction_p90, r.paired->steps, r.paired->read_bytes_per_s_median * 1e-9);
  return row;
}

nlohmann::json to_json(const LlamaCppComparison& c) {
  const LlamaCppBenchResult& l = c.llama_cpp;
  return {{"kind", "llama_cpp"},
          {"model", c.kiln.model},
          {"dtype", c.kiln.dtype},
          {"gguf", l.gguf},
          {"llama_bench", l.llama_bench},
          {"build_commit", l.build_commit},
          {"threads", l.threads},
          {"prompt_tokens", l.prompt_tokens},
          {"gen_tokens", l.gen_tokens},
          {"decode_depth", l.decode_depth},
          {"kv_type", l.kv_type},
          {"kiln_kv_dtype", c.kiln.kv_dtype},
          {"prefill_tokens_per_s", l.prefill_tokens_per_s},
          {"decode_tokens_per_s", l.decode_tokens_per_s},
          {"kiln_prefill_tokens_per_s", c.kiln.prefill_tokens_per_s},
          {"kiln_decode_tokens_per_s", c.kiln.decode_tokens_per_s},
          {"prefill_ratio", c.prefill_ratio},
          {"decode_ratio", c.decode_ratio},
          {"read_gb_per_s", c.llama_cpp_read_bytes_per_s * 1e-9},
          {"roofline_fraction", c.llama_cpp_roofline_fraction},
          {"kiln_read_gb_per_s", c.kiln.read_bytes_per_s * 1e-9},
          {"round_reads_gb_per_s", {c.reads[0] * 1e-9, c.reads[1] * 1e-9, c.reads[2] * 1e-9}},
          {"round_trips_ns", {c.round_trips_ns[0], c.round_trips_ns[1], c.round_trips_ns[2]}},
          {"same_phase", c.same_phase}};
}

// Under the model table's columns: llama.cpp's pp and tg figures, then kiln's over them.
std::string table_row(const LlamaCppComparison& c) {
  const LlamaCppBenchResult& l = c.llama_cpp;
  const std::string build = l.build_commit.empty() ? "" : " " + l.build_commit;
  std::string row = fmt::format("{:<24} {:>7} {:>9} {:>12} {:>12.1f} {:>12.1f}", "  llama.cpp" + build, l.threads, "",
                                "", l.prefill_tokens_per_s, l.decode_tokens_per_s);
  if (c.llama_cpp_read_bytes_per_s > 0)
    row += fmt::format(" {:>10.1f} {:>14.1f} {:>8.1f}%", c.llama_cpp_read_bytes_per_s * 1e-9,
                       l.decode_tokens_per_s / c.llama_cpp_roofline_fraction, 100.0 * c.llama_cpp_roofline_fraction);
  // What its generation test decoded after, and in which KV cache, beside kiln's.
  row += fmt::format("  (tg after {} tokens; KV {}, kiln's {})", l.decode_depth, l.kv_type.empty() ? "?" : l.kv_type,
                     c.kiln.kv_dtype);
  row += fmt::format("\n{:<24} {:>7} {:>9} {:>12} {:>11.2f}x {:>11.2f}x", "  kiln / llama.cpp", l.threads, "", "",
                     c.prefill_ratio, c.decode_ratio);
  if (c.llama_cpp_read_bytes_per_s > 0)
    row += fmt::format("  ({}: reads {:.1f}, {:.1f}, {:.1f} GB/s; threads' round trips {:.0f}, {:.0f}, {:.0f} ns)",
                       c.same_phase ? "one phase" : "phases differ", c.reads[0] * 1e-9, c.reads[1] * 1e-9,
                       c.reads[2] * 1e-9, c.round_trips_ns[0], c.round_trips_ns[1], c.round_trips_ns[2]);
  return row;
}

nlohmann::json to_json(const LlamaCppRounds& r) {
  return {{"kind", "llama_cpp_rounds"},
          {"model", r.model},
          {"dtype", r.dtype},
          {"threads", r.threads},
          {"rounds", r.rounds},
          {"prefill_ratio_min", r.prefill_ratio_min},
          {"prefill_ratio_max", r.prefill_ratio_max},
          {"decode_ratio_min", r.decode_ratio_min},
          {"decode_ratio_max", r.decode_ratio_max},
          {"same_phase_rounds", r.same_phase_rounds},
          {"same_phase_prefill_ratio_min", r.same_phase_prefill_ratio_min},
          {"same_phase_prefill_ratio_max", r.same_phase_prefill_ratio_max},
          {"same_phase_decode_ratio_min", r.same_phase_decode_ratio_min},
          {"same_phase_decode_ratio_max", r.same_phase_decode_ratio_max}};
}

std::string table_row(const LlamaCppRounds& r) {
  std::string row =
      fmt::format("{:<24} {:>7} {:>9} {:>12} {:>12} {:>12}", fmt::format("  over {} rounds", r.rounds), r.threads, "",
                  "", fmt::format("{:.2f}-{:.2f}x", r.prefill_ratio_min, r.prefill_ratio_max),
                  fmt::format("{:.2f}-{:.2f}x", r.decode_ratio_min, r.decode_ratio_max));
  if (r.same_phase_rounds > 0)
    row += fmt::format("\n{:<24} {:>7} {:>9} {:>12} {:>12} {:>12}",
                       fmt::format("  over {} of one phase", r.same_phase_rounds), r.threads, "", "",
                       fmt::format("{:.2f}-{:.2f}x", r.same_phase_prefill_ratio_min, r.same_phase_prefill_ratio_max),
                       fmt::format("{:.2f}-{:.2f}x", r.same_phase_decode_ratio_min, r.same_phase_decode_ratio_max));
  return row;
}

namespace {

// `unit`: what the rows count per ("token" of a single stream, "step" of the engine). With a measured
// `read_bytes_per_s`, the ops that stream weights say how close to that read they ran.
std::string profile_rows(const std::string& title, const std::vector<DecodeProfileEntry>& entries,
                         const char* unit, double read_bytes_per_s) {
  double step = 0;
  for (const DecodeProfileEntry& e : entries) step += e.seconds_per_token;
  std::string out = fmt::format("  {}: {:.3f} ms per {}\n", title, step * 1e3, unit);
  out += fmt::format("  {:<40} {:>14} {:>12} {:>8} {:>12} {:>8}\n", "graph: op (weights per launch)",
                     fmt::format("launches/{}", unit), fmt::format("us/{}", unit), "share", "weight GB/s",
                     "of read");
  for (const DecodeProfileEntry& e : entries) {
    std::string label = e.graph.empty() ? e.op : e.graph + ": " + e.op;
    if (const double bytes = static_cast<double>(e.weight_bytes_per_launch); bytes >= 1e6)
      label += fmt::format(" ({:.2f} MB)", bytes * 1e-6);
    else if (bytes > 0)
      label += fmt::format(" ({:.1f} kB)", bytes * 1e-3);
    out += fmt::format("  {:<40} {:>14.1f} {:>12.1f} {:>7.1f}%", label, e.launches_per_token,
                       e.seconds_per_token * 1e6, 100.0 * e.fraction);
    if (const double rate = e.weight_bytes_per_s(); rate > 0) {
      out += fmt::format(" {:>12.1f}", rate * 1e-9);
      if (read_bytes_per_s > 0) out += fmt::format(" {:>7.1f}%", 100.0 * rate / read_bytes_per_s);
    }
    out += "\n";
  }
  return out;
}

}  // namespace

std::string profile_table(const ModelBenchResult& r) {
  if (r.decode_profile.empty()) return "";
  return profile_rows(fmt::format("decode step profile ({} {}, {} threads)", r.model,
                                  r.dtype, r.threads),
                      r.decode_profile, "token", r.read_bytes_per_s);
}

std::string profile_table(const ConcurrencyBenchResult& r) {
  if (r.step_profile.empty()) return "";
  return profile_rows(fmt::format("engine step profile ({} {}, {} threads, concurrency {}, {} steps)", r.model,
                                  r.dtype, r.threads, r.concurrency, r.steps),
                      r.step_profile, "step", 0);
}

std::string gemm_table_header() {
  return fmt::format("{:<22} {:<9} {:>7} {:>10} {:>10} {:>13} {:>15} {:>12} {:>12} {:>10} {:>12} {:>14} {:>9}",
                     "gemm M x N x K", "dtype", "threads", "ms", "weight GB/s", "kiln GFLOP/s", "oneDNN GFLOP/s",
                     "kiln/oneDNN",
                     "peak GFLOP/s", "kiln/peak", "oneDNN/peak", "bf16 dot peak", "kiln/dot");
}

std::string table_row(const GemmBenchResult& r) {
  const std::string onednn = r.onednn_gflops ? fmt::format("{:.1f}", *r.onednn_gflops) : "n/a";
  const std::string ratio = r.onednn_gflops ? fmt::format("{:.2f}", r.gflops / *r.onednn_gflops) : "n/a";
  const std::string onednn_peak =
      r.onednn_gflops ? fmt::format("{:.1f}%", 100.0 * *r.onednn_gflops / r.peak_gflops) : "n/a";
  const std::string dot_peak = r.bf16_dot_peak_gflops ? fmt::format("{:.1f}", *r.bf16_dot_peak_gflops) : "-";
  const std::string dot_fraction =
      r.bf16_dot_peak_gflops ? fmt::format("{:.1f}%", 100.0 * r.gflops / *r.bf16_dot_peak_gflops) : "-";
  // f32 activations against a weight format: "f32 x q8_0"
  const std::string dtype = r.weights ? fmt::format("f32 x {}", nn::weight_format_name(*r.weights))
                                      : std::string(dtype_name(r.dtype));
  return fmt::format("{:<22} {:<9} {:>7} {:>10.3f} {:>10.1f} {:>13.1f} {:>15} {:>12} {:>12.1f} {:>9.1f}% {:>12} {:>14} {:>9}",
                     fmt::format("{} x {} x {}", r.m, r.n, r.k), dtype, r.threads, r.seconds * 1e3,
                     r.weight_gb_per_s, r.gflops,
                     onednn, ratio, r.peak_gflops, 100.0 * r.gflops / r.peak_gflops, onednn_peak, dot_peak,
                     dot_fraction);
}

std::string bandwidth_table_header() {
  return fmt::format("{:<9} {:>10} {:>7} {:>10} {:>16} {:>28} {:>15}", "bandwidth", "buffer MiB", "passes",
                     "read GB/s", "best streams/thread", "GB/s at 1 / 2 / 4 / 8 streams", "round trip ns");
}

std::string table_row(const BandwidthResult& r) {
  std::string by_streams;
  for (const auto& [streams, rate] : r.read_bytes_per_s_by_streams)
    by_streams += fmt::format("{}{:.1f}", by_streams.empty() ? "" : " / ", rate * 1e-9);
  const std::string round_trip = r.core_round_trip_ns > 0 ? fmt::format("{:.0f}", r.core_round_trip_ns) : "-";
  return fmt::format("{:<9} {:>10} {:>7} {:>10.1f} {:>16} {:>28} {:>15}", fmt::format("{} thr", r.threads),
                     r.buffer_bytes >> 20, r.passes, r.read_bytes_per_s * 1e-9, r.streams_per_thread, by_streams,
                     round_trip);
}

nlohmann::json to_json(const ConcurrencyBenchResult& r) {
  return {{"kind", "concurrency"},
          {"model", r.model},
          {"dtype", r.dtype},
          {"threads", r.threads},
          {"concurrency", r.concurrency},
          {"prompt_tokens", r.prompt_tokens},
          {"gen_tokens", r.gen_tokens},
          {"seconds", r.seconds},
          {"output_tokens", r.output_tokens},
          {"output_tokens_per_s", r.output_tokens_per_s},
          {"aggregate_decode_tokens_per_s", r.aggregate_decode_tokens_per_s},
          {"steady_decode_tokens_per_s", r.steady_decode_tokens_per_s},
          {"steady_decode_tokens", r.steady_decode_tokens},
          {"ttft_p50_s", r.ttft_p50_s},
          {"ttft_p99_s", r.ttft_p99_s},
          {"tpot_p50_s", r.tpot_p50_s},
          {"tpot_p99_s", r.tpot_p99_s},
          {"kv_blocks_peak", r.kv_blocks_peak},
          {"kv_blocks_total", r.kv_blocks_total},
          {"preemptions", r.preemptions},
          {"steps", r.steps}};
}

std::string concurrency_table_header(int64_t prompt_tokens, int64_t gen_tokens) {
  return fmt::format("{:<14} {:<9} {:>7} {:>6} {:>14} {:>13} {:>12} {:>19} {:>19} {:>13}  (prompt {}, gen {} per request)",
                     "model", "dtype", "threads", "conc", "decode tok/s", "steady tok/s", "out tok/s", "ttft p50/p99 ms",
                     "tpot p50/p99 ms", "kv blocks", prompt_tokens, gen_tokens);
}

std::string table_row(const ConcurrencyBenchResult& r) {
  return fmt::format("{:<14} {:<9} {:>7} {:>6} {:>14.1f} {:>13.1f} {:>12.1f} {:>19} {:>19} {:>13}", r.model,
                     r.dtype, r.threads, r.concurrency, r.aggregate_decode_tokens_per_s,
                     r.steady_decode_tokens_per_s, r.output_tokens_per_s,
                     fmt::format("{:.1f}/{:.1f}", r.ttft_p50_s * 1e3, r.ttft_p99_s * 1e3),
                     fmt::format("{:.2f}/{:.2f}", r.tpot_p50_s * 1e3, r.tpot_p99_s * 1e3),
                     fmt::format("{}/{}", r.kv_blocks_peak, r.kv_blocks_total));
}

}  // namespace kiln::bench
