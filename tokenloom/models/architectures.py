"""The one table of supported architectures: HF name -> its config.json model_type and the class
that implements it. ModelConfig validates against it; models/registry.py imports from it.

Adding an architecture: a row here, its ModelConfig.from_hf branch where its config.json
spells things its own way, and its model class (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    hf_name: str  # config.json "architectures"[0]
    model_type: str  # config.json "model_type"
    module: str  # where the implementing CausalLM lives
    class_name: str


ARCHITECTURES: dict[str, Architecture] = {
    a.hf_name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", "tokenloom.models.llama", "LlamaForCausalLM"),
        Architecture("MistralForCausalLM", "mistral", "tokenloom.models.llama", "LlamaForCausalLM"),
        Architecture("Qwen2ForCausalLM", "qwen2", "tokenloom.models.llama", "LlamaForCausalLM"),
        Architecture("Qwen3ForCausalLM", "qwen3", "tokenloom.models.llama", "LlamaForCausalLM"),
        Architecture("SmolLM3ForCausalLM", "smollm3", "tokenloom.models.llama", "LlamaForCausalLM"),
        Architecture("MixtralForCausalLM", "mixtral", "tokenloom.models.moe", "MixtralForCausalLM"),
        Architecture("Qwen2MoeForCausalLM", "qwen2_moe", "tokenloom.models.moe", "MoeForCausalLM"),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "tokenloom.models.moe", "MoeForCausalLM"),
        Architecture("Phi3ForCausalLM", "phi3", "tokenloom.models.phi3", "Phi3ForCausalLM"),
        Architecture("OlmoeForCausalLM", "olmoe", "tokenloom.models.moe", "OlmoeForCausalLM"),
        Architecture("GptOssForCausalLM", "gpt_oss", "tokenloom.models.gpt_oss", "GptOssForCausalLM"),
        Architecture("DeepseekV2ForCausalLM", "deepseek_v2", "tokenloom.models.deepseek", "DeepseekForCausalLM"),
        Architecture("DeepseekV3ForCausalLM", "deepseek_v3", "tokenloom.models.deepseek", "DeepseekForCausalLM"),
        Architecture("GraniteForCausalLM", "granite", "tokenloom.models.granite", "GraniteForCausalLM"),
        Architecture("GraniteMoeForCausalLM", "granitemoe", "tokenloom.models.granite", "GraniteMoeForCausalLM"),
        Architecture(
            "GraniteMoeSharedForCausalLM", "granitemoeshared", "tokenloom.models.granite", "GraniteMoeForCausalLM"
        ),
        Architecture(
            "GraniteMoeHybridForCausalLM",
            "granitemoehybrid",
            "tokenloom.models.granite_hybrid",
            "GraniteMoeHybridForCausalLM",
        ),
        Architecture("Qwen3NextForCausalLM", "qwen3_next", "tokenloom.models.qwen3_next", "Qwen3NextForCausalLM"),
        Architecture("Olmo2ForCausalLM", "olmo2", "tokenloom.models.olmo2", "Olmo2ForCausalLM"),
        Architecture("Olmo3ForCausalLM", "olmo3", "tokenloom.models.olmo2", "Olmo2ForCausalLM"),
        Architecture("Glm4ForCausalLM", "glm4", "tokenloom.models.glm4", "Glm4ForCausalLM"),
        Architecture("Cohere2ForCausalLM", "cohere2", "tokenloom.models.cohere2", "Cohere2ForCausalLM"),
        Architecture("StableLmForCausalLM", "stablelm", "tokenloom.models.stablelm", "StableLmForCausalLM"),
        Architecture("Gemma2ForCausalLM", "gemma2", "tokenloom.models.gemma", "Gemma2ForCausalLM"),
        Architecture("Gemma3ForCausalLM", "gemma3_text", "tokenloom.models.gemma", "Gemma3ForCausalLM"),
        Architecture("GPT2LMHeadModel", "gpt2", "tokenloom.models.gpt2", "GPT2LMHeadModel"),
    )
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}
