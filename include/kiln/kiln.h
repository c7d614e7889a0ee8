// kiln: build, compile and run inference graphs (after Modular MAX's graph layer), natively in C++.
//
//   #include <kiln/kiln.h>
//   using namespace kiln;
//
//   // 1. Build a graph: a 2-layer MLP over a symbolic batch.
//   graph::Graph g("mlp", {graph::TensorType{DType::f32, {"batch", 4}}});
//   {
//     graph::Graph::Scope scope(g);
//     graph::TensorValue x = g.input(0);
//     auto w1 = g.weight({"w1", DType::f32, {4, 8}});
//     auto w2 = g.weight({"w2", DType::f32, {8, 2}});
//     g.output({graph::ops::matmul(graph::ops::relu(graph::ops::matmul(x, w1)), w2)});
//   }
//   std::cout << g.to_string();                    // the graph's text form
//
//   // 2. Compile it and bind weights (weights are bound late: one compile, many inits).
//   engine::InferenceSession session({DeviceRef::CPU()});
//   WeightsRegistry weights{{"w1", Tensor::zeros(DType::f32, {4, 8})},
//                           {"w2", Tensor::zeros(DType::f32, {8, 2})}};
//   engine::Model model = session.load(g, weights);
//
//   // 3. Run it: "batch" is bound from the input's shape.
//   std::vector<Tensor> out = model.execute({Tensor::zeros(DType::f32, {3, 4})});  // f32[3, 2]
//
// Layers (DESIGN.md, docs/architecture.md): graph (types, IR, ops, text); tensor (memory, DLPack);
// compiler (passes, plans); engine (sessions, models, backends); nn (modules); pipelines; serve. Each
// header below is one concept; this one brings every public header but kiln/extension.h, the C ABI
// that extension libraries include on their own (tests/docs/doc_examples.py checks the list).
#pragma once

#include "kiln/errors.h"
#include "kiln/version.h"
#include "kiln/logging.h"
#include "kiln/graph/custom_op_check.h"
#include "kiln/graph/device.h"
#include "kiln/graph/dim.h"
#include "kiln/graph/dtype.h"
#include "kiln/graph/elementwise_program.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/kernel_key.h"
#include "kiln/graph/op.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/quantization.h"
#include "kiln/graph/signals.h"
#include "kiln/graph/text.h"
#include "kiln/graph/tree.h"
#include "kiln/graph/types.h"
#include "kiln/tensor/device_memory.h"
#include "kiln/tensor/tensor.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/compiler/kernel_catalog.h"
#include "kiln/compiler/passes.h"
#include "kiln/kernels/cpu_probes.h"
#include "kiln/ext/extensions.h"
#include "kiln/engine/compile_cache.h"
#include "kiln/engine/weight_cache.h"
#include "kiln/engine/distributed.h"
#include "kiln/engine/model.h"
#include "kiln/engine/session.h"
#include "kiln/engine/signals.h"
#include "kiln/distributed.h"
#include "kiln/nn/attention.h"
#include "kiln/nn/eager_session.h"
#include "kiln/nn/embedding.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/linear.h"
#include "kiln/nn/mlp.h"
#include "kiln/nn/module.h"
#include "kiln/nn/module_v3.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/rotary_embedding.h"
#include "kiln/nn/tensor.h"
#include "kiln/nn/tensor_parallel.h"
#include "kiln/nn/transformer.h"
#include "kiln/nn/weight_format.h"
#include "kiln/pipelines/chat_template.h"
#include "kiln/pipelines/generation_engine.h"
#include "kiln/pipelines/gguf.h"
#include "kiln/pipelines/gguf_model.h"
#include "kiln/pipelines/graph_spec.h"
#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/kv_block_pool.h"
#include "kiln/pipelines/safetensors.h"
#include "kiln/pipelines/stop_strings.h"
#include "kiln/pipelines/text_generation.h"
#include "kiln/pipelines/tokenizer.h"
#include "kiln/pipelines/weight_conversion.h"
#include "kiln/serve/server.h"
