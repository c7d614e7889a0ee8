"""Pipelines: ``GraphSpec``, ``compile_graph_specs``, the text-generation pipeline and the batching engine."""
from kiln._kiln.pipelines import (EngineStats, GenerationEngine, GenerationOutput, GraphSpec, SamplingParams,
                                  TextGenerationPipeline, compile_graph_specs)

__all__ = ["EngineStats", "GenerationEngine", "GenerationOutput", "GraphSpec", "SamplingParams",
           "TextGenerationPipeline", "compile_graph_specs"]
