"""The engine: EngineCore (request state, KV cache, steps) under an OutputProcessor (text)."""

from tokenloom.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
