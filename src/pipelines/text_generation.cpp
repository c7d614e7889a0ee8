// TextGenerationPipeline: one blocking request of a GenerationEngine per generate().
#include "kiln/pipelines/text_generation.h"

#include <fmt/format.h>

namespace kiln::pipelines {

TextGenerationPipeline TextGenerationPipeline::from_config(const nn::LlamaConfig& config,
                                                           const WeightsRegistry& weights,
                                                           std::shared_ptr<const Tokenizer> tokenizer,
                                                           std::vector<int64_t> eos_token_ids,
                                                           PipelineOptions options) {
  return TextGenerationPipeline(std::make_shared<GenerationEngine>(config, weights, std::move(tokenizer),
                                                                   std::move(eos_token_ids), std::move(options)));
}

TextGenerationPipeline TextGenerationPipeline::from_dir(const std::filesystem::path& model_dir,
                                                        PipelineOptions options) {
  return TextGenerationPipeline(GenerationEngine::from_dir(model_dir, std::move(options)));
}

graph::Module TextGenerationPipeline::trace_graphs(const nn::LlamaConfig& config, PipelineOptions options) {
  return GenerationEngine::trace_graphs(config, options);
}

int64_t TextGenerationPipeline::sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
                                       float u) const {
  const auto& models = engine_->models();
  if (temperature <= 0 || top_k == 1) return models.at("greedy").execute({logits}).at(0).to_vector<int64_t>().at(0);
  std::vector<Tensor> out = models.at("sampler").execute(
      {logits, Tensor::from_vector<float>({static_cast<float>(temperature)}, {1}),
       Tensor::from_vector<int64_t>({top_k}, {1}), Tensor::from_vector<float>({static_cast<float>(top_p)}, {1}),
       Tensor::from_vector<float>({0.0f}, {1}), Tensor::from_vector<float>({u}, {1})});
  return out.at(0).to_vector<int64_t>().at(0);
}

namespace {

SamplingParams sampling_params(const GenerationOptions& o) {
  SamplingParams p;
  p.max_new_tokens = o.max_new_tokens;
  p.temperature = o.temperature;
  p.top_k = o.top_k;
  p.top_p = o.top_p;
  p.seed = o.seed;
  p.ignore_eos = !o.stop_at_eos;
  return p;
}

}  // namespace

void check_generation_options(const GenerationOptions& options) { check_sampling(sampling_params(options)); }

namespace {

GenerationResult result_of(GenerationOutput out) {
  if (out.finish == FinishReason::error) throw ExecutionError("generate: " + out.error);
  GenerationResult result;
  for (const GeneratedToken& t : out.tokens) result.ids.push_back(t.id);
  result.text = std::move(out.text);
  result.stats = generation_stats(out.metrics, out.finish);
  return result;
}

}  // namespace

GenerationStats generation_stats(const RequestMetrics& m, FinishReason finish) {
  GenerationStats s;
  s.prompt_tokens = m.prompt_tokens;
  s.generated_tokens = m.generated_tokens;
  s.finish_reason = finish;
  if (m.generated_tokens > 0) {
    s.prefill_seconds = m.first_token_s;
    s.decode_seconds = m.finish_s - m.first_token_s;
  }
  if (s.prefill_seconds > 0) s.prefill_tokens_per_s = static_cast<double>(s.prompt_tokens) / s.prefill_seconds;
  if (s.decode_seconds > 0 && s.generated_tokens > 1)
    s.decode_tokens_per_s = static_cast<double>(s.generated_tokens - 1) / s.decode_seconds;
  return s;
}

GenerationResult TextGenerationPipeline::generate_ids(const std::vector<int64_t>& prompt_ids,
                                                      const GenerationOptions& options,
                                                      const std::function<void(int64_t)>& on_token) {
  if (prompt_ids.empty()) throw ValueError("generate: the prompt is empty (at least one token is needed)");
  GenerationRequest request;
  request.prompt_ids = prompt_ids;
  request.sampling = sampling_params(options);
  if (on_token)
    request.on_update = [&on_token](const RequestUpdate& u) {
      for (const GeneratedToken& t : u.tokens) on_token(t.id);
    };
  return result_of(engine_->generate(std::move(request)));
}

GenerationResult TextGenerationPipeline::generate(std::string_view prompt, const GenerationOptions& options,
                                                  const std::function<void(std::string_view)>& on_text) {
  if (!engine_->tokenizer()) throw ValueError("generate: this pipeline has no tokenizer (use generate_ids)");
  GenerationRequest request;
  request.prompt = std::string(prompt);
  request.sampling = sampling_params(options);
  if (on_text)
    request.on_update = [&on_text](const RequestUpdate& u) {
      if (!u.text.empty()) on_text(u.text);
    };
  return result_of(engine_->generate(std::move(request)));
}

GenerationEngine& TextGenerationPipeline::engine() const { return *engine_; }
const nn::LlamaConfig& TextGenerationPipeline::config() const { return engine_->config(); }
int64_t TextGenerationPipeline::max_seq_len() const { return engine_->max_seq_len(); }
int64_t TextGenerationPipeline::sampler_cap() const { return engine_->sampler_cap(); }
const Tokenizer* TextGenerationPipeline::tokenizer() const { return engine_->tokenizer(); }
const std::vector<int64_t>& TextGenerationPipeline::eos_token_ids() const { return engine_->eos_token_ids(); }
const std::map<std::string, engine::Model>& TextGenerationPipeline::models() const { return engine_->models(); }
int64_t TextGenerationPipeline::compile_count() const { return engine_->compile_count(); }

}  // namespace kiln::pipelines
