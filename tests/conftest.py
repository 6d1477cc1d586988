"""Shared fixtures: tiny random-weight HF models of every architecture, and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, the Triton kernels run in Triton's interpreter on the CPU (read when a kernel is
# defined, so before any tokenloom.kernels.triton module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_scalars_index_under_numpy_2_4() -> None:
    """Triton 3.6's interpreter holds a scalar as a one-element array and converts it with
    int(array), which NumPy 2.4 refuses for arrays of one dimension: a loop bound read from memory
    (range(start, seq_len)) then fails. Convert through the array's one element instead."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalars_index_under_numpy_2_4()


def _one_ssl_context_per_setting_for_every_httpx_client() -> None:
    """The tests build hundreds of httpx clients (``httpx.get``/``post`` build one per call, and the
    openai client one each), and httpx loads the CA bundle into a new SSL context for each, which
    costs more than the local request it sends. An SSL context may be shared across clients, so one
    per (verify, cert, trust_env) serves them all (the tests speak plain HTTP to local servers; a
    shared context would carry one client's ALPN setting to the next, which HTTPS with http2 minds)."""
    from httpx._transports import default

    original, contexts = default.create_ssl_context, {}

    def shared(verify=True, cert=None, trust_env=True):
        if not isinstance(verify, (bool, str)) or not isinstance(cert, (str, type(None))):
            return original(verify=verify, cert=cert, trust_env=trust_env)  # a caller's own context
        key = (verify, cert, trust_env)
        if key not in contexts:
            contexts[key] = original(verify=verify, cert=cert, trust_env=trust_env)
        return contexts[key]

    default.create_ssl_context = shared


_one_ssl_context_per_setting_for_every_httpx_client()

from tests.helpers.browser_harness import browser  # noqa: F401 (a fixture: the playground's tests share one Chromium)
from tests.helpers.turns import (
    pytest_runtest_protocol,  # noqa: F401 (a hook: serial tests run alone under xdist)
    serial_tests_last_in_their_file,
)

VOCAB = 320
# DeepSeek's YaRN: a mscale (equal to mscale_all_dim, as the released models set them) squared into
# the softmax scale
_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

# name -> (transformers config class, kwargs). Small enough to run in milliseconds,
# different enough to exercise every flag: GQA/MQA, tied/untied, biases, q/k norm,
# rope scaling, sliding window.
TINY_CONFIGS = {
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_mqa_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3_rope_scaling": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama_linear_rope_bias": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_bias=True,
            mlp_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "llama_yarn": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        ),
    ),
    "mistral_sliding": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12, head_dim=16),
    ),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # layer 0 attends to everything, layer 1 to the last 6 positions (max_window_layers)
    "qwen2_window_layers": (
        "Qwen2Config",
        dict(
            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=1
        ),
    ),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    # every fourth layer attends without rope (layer 3 of 4)
    "smollm3": ("SmolLM3Config", dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)),
    # sliding then full layer, each with its own rope base; scale from query_pre_attn_scalar; soft-capped logits
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
        ),
    ),
    # every layer sparse, top-2 of 4 renormalized
    "mixtral": (
        "MixtralConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    # 8 experts top-2 not renormalized, a sigmoid-gated shared expert, q/k/v bias
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
    ),
    # layer 0 dense (mlp_only_layers), layer 1 top-3 of 6 renormalized; q/k norm
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    # fused qkv / gate_up checkpoint tensors, half the head rotated, every layer sliding
    "phi3_partial_rotary": (
        "Phi3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=10),
    ),
    # longrope past an original length of 2: the long factors and attention factor at every length
    # (the short ones: tests/models/test_rope_scaling.py)
    "phi3_longrope": (
        "Phi3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            original_max_position_embeddings=2,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + i / 8 for i in range(8)],
                "long_factor": [1.5 + i / 2 for i in range(8)],
            },
        ),
    ),
    "llama_dynamic": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    ),
    # sliding then full layer, attention scores and logits soft-capped (caps small enough to bite)
    "gemma2": (
        "Gemma2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=8.0,
        ),
    ),
    # every layer sparse, top-3 of 8 not renormalized, q/k normed over the whole projection
    "olmoe": (
        "OlmoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
    ),
    "olmo2": ("Olmo2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    # four norms a layer, half of each head turned in interleaved pairs, q/k/v bias
    "glm4": ("Glm4Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    # one LayerNorm, attention and MLP side by side; three sliding layers with interleaved rope, a
    # full one without; q/k/v/o bias; logits scaled
    "cohere2": (
        "Cohere2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, sliding_window=6, attention_bias=True),
    ),
    # three sliding layers and a full one, each kind with its own rope base
    "olmo3": (
        "Olmo3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=4,
            sliding_window=6,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        ),
    ),
    # sinks, sliding then full layer, YaRN past a short original length, top-2 of 4 experts with
    # router bias, clamped SwiGLU with a limit small enough to bite
    "gpt_oss": (
        "GptOssConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            swiglu_limit=0.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    # latent attention with a q bottleneck, YaRN with mscale past a short original length, a
    # dense first layer then 8 experts in 4 groups (2 chosen) by sigmoid with a correction bias,
    # renormalized and scaled, and a shared expert
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=24,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            rope_parameters=_DEEPSEEK_YARN,
        ),
    ),
    # Granite's four multipliers, each away from its neutral value (and the softmax scale from its own)
    "granite": (
        "GraniteConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.15,
            logits_scaling=8.0,
            tie_word_embeddings=True,
        ),
    ),
    # Granite's multipliers around JetMoE's stacked experts (top-2 of 4), with a shared MLP beside them
    "granitemoe_shared": (
        "GraniteMoeSharedConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.15,
            logits_scaling=8.0,
        ),
    ),
    # Granite 4.0-H's layout: Mamba-2 layers (two groups of heads; transformers scans a prompt in
    # chunks of 8 positions, so its reference spans several) around one attention layer without
    # rope, a routed mixture beside the shared MLP, every multiplier away from neutral
    "granite_hybrid": (
        "GraniteMoeHybridConfig",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_chunk_size=8,
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            position_embedding_type="nope",
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.15,
            logits_scaling=8.0,
        ),
    ),
    # Granite 4.0-H's dense members: no experts (the shared MLP is the MLP), attention with rope
    "granite_hybrid_dense": (
        "GraniteMoeHybridConfig",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["attention", "mamba", "mamba"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=8,
            mamba_chunk_size=16,
            shared_intermediate_size=96,
            num_local_experts=0,
            position_embedding_type="rope",
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
        ),
    ),
    # Qwen3-Next: Gated DeltaNet layers (two key heads each serving two value heads, value heads
    # narrower than keys) around one gated attention layer, the mixture with its gated shared
    # expert and one dense layer, a quarter of each attention head turned
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            intermediate_size=96,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[2],
            initializer_range=0.1,
        ),
    ),
    # V2-Lite's layout: queries without a bottleneck, softmax routing over groups, not renormalized
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            rope_parameters=_DEEPSEEK_YARN,
        ),
    ),
    # LayerNorm with bias, a quarter of each head rotated, q/k/v bias, per-head q/k LayerNorm
    "stablelm": (
        "StableLmConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, use_qkv_bias=True, qk_layernorm=True),
    ),
    # attention and MLP side by side on one normed input
    "stablelm_parallel": (
        "StableLmConfig",
        dict(num_attention_heads=4, num_key_value_heads=4, use_parallel_residual=True),
    ),
    "gpt2": (
        "GPT2Config",
        dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            vocab_size=VOCAB,
            initializer_range=0.2,
            bos_token_id=None,
            eos_token_id=None,
        ),
    ),
}


def _llama_like_kwargs(extra: dict) -> dict:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        rms_norm_eps=1e-6,
    )
    return base | extra


def make_tiny_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with < VOCAB tokens, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    text = ["The quick brown fox jumps over the lazy dog. Once upon a time there was a cat."] * 20
    tk.train_from_iterator(text, trainer)
    tk.save(str(folder / "tokenizer.json"))


def build_tiny_model(name: str, folder: Path, seed: int = 0) -> Path:
    import transformers

    cls_name, extra = TINY_CONFIGS[name]
    cfg_cls = getattr(transformers, cls_name)
    kwargs = extra if cls_name == "GPT2Config" else _llama_like_kwargs(extra)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # norms init at 0 (Gemma's 1 + w) or 1: make w count
    if cls_name in ("Gemma2Config", "Gemma3TextConfig", "Olmo2Config", "OlmoeConfig", "StableLmConfig"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or ".norms." in name:
                    p.normal_(0.0 if cls_name.startswith("Gemma") else 1.0, 0.3)
                elif name.endswith("norm.bias"):
                    p.normal_(0.0, 0.3)
    if cls_name == "Qwen3NextConfig":  # (1 + w) norms init at 0, the DeltaNet's gated norm at 1
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.3)
    if cls_name == "DeepseekV3Config":  # a correction bias large enough to change choices
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    make_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: architecture name -> folder of a saved random-weight HF model (built once)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build_tiny_model(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2) as an HF folder of float32 weights, for parity with
    transformers (`make test` prepares it first)."""
    from tokenloom.loader import hub

    return hub.float32_folder()


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF file, as pulled (Q4_1 blocks)."""
    from tokenloom.loader import hub

    return hub.pull()


@pytest.fixture(scope="session")
def smol_llm(default_model_dir):
    """One LLM over the real default model, shared by the tests that only generate."""
    from tokenloom import LLM

    return LLM(str(default_model_dir), kv_cache_memory=256 << 20)


def pytest_collection_modifyitems(config, items):
    serial_tests_last_in_their_file(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
