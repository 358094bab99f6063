"""Policy model presets: build a causal LM and its tokenizer from a local directory or a preset name.

Presets need no download: ``tiny`` is a small Qwen2-architecture model with seeded random weights and
a character-level tokenizer (printable ASCII plus ``<pad>``, ``<s>``, ``</s>``, ``<unk>``) with a
ChatML chat template, the embedded default policy of tests and CPU runs; ``tiny-hd32`` is the same
with head_dim 32, which vLLM's CPU build also serves (``rollout.backend: vllm``). ``qwen3-30m-shape`` is a
~31M-parameter Qwen3 (per-head q/k norms, grouped-query attention, tied embeddings, the char
tokenizer's vocabulary) with random weights, large enough that a CPU throughput benchmark measures
the model rather than per-request overhead. ``qwen3-0.6b-shape`` has Qwen3-0.6B's dimensions with
random weights, for GPU throughput benchmarks.

Weights are only ever read from safetensors (``use_safetensors=True``), never from pickles.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
_TINY_SEED = 1234
# ChatML as Qwen2.5 writes it, tools included (without Qwen's instructions, to fit the tiny model's
# context): a ``<tools>`` block in the system turn, assistant ``tool_calls`` as ``<tool_call>`` JSON,
# ``tool`` messages as ``<tool_response>`` user turns. (The char tokenizer has no newline: it encodes
# as ``<unk>``.)
TINY_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set args = call.function.arguments %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' "
    "+ (args if args is string else args | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_char_tokenizer() -> Any:
    """A character-level fast tokenizer over printable ASCII plus pad/bos/eos/unk.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` that ``save_pretrained`` can write and
        ``AutoTokenizer`` can reload.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token, so WordLevel works as a char model.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


def _seeded(build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    # Fork the RNG so building a preset never disturbs the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _build_tiny(dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        # Grouped-query attention with one kv head (group of 4, as in Qwen's small models): the
        # KV cache is a quarter of multi-head's, and a CPU decode step's attention, which is
        # many tiny GEMMs, costs half of what two kv heads would.
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # A larger init than the default 0.02 so random outputs are not near-uniform (greedy decoding
    # then depends visibly on the weights, which the weight-update tests rely on).
    config.initializer_range = 0.1
    model = _seeded(lambda: AutoModelForCausalLM.from_config(config, dtype=dtype), _TINY_SEED)
    return model.eval(), tokenizer


def _build_tiny_hd32(dtype: torch.dtype) -> tuple[Any, Any]:
    """``tiny`` with head_dim 32 (3 query heads of 32 over the same hidden size 96, one kv head):
    the smallest shape vLLM's CPU attention serves (it refuses head_dim 24, ``tiny``'s), so both
    engines load the same weights (``configs/*_vllm.yaml``, the differential tests)."""
    model, tokenizer = _build_tiny(dtype)
    config = model.config
    config.num_attention_heads = 3
    config.head_dim = 32
    from transformers import AutoModelForCausalLM

    model = _seeded(lambda: AutoModelForCausalLM.from_config(config, dtype=dtype), _TINY_SEED)
    return model.eval(), tokenizer


def _build_qwen3_shape(dtype: torch.dtype, **shape: Any) -> tuple[Any, Any]:
    """A randomly initialised Qwen3 of the given shape, with the char tokenizer (no download)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{"vocab_size": len(tokenizer), **shape},
    )
    model = _seeded(lambda: AutoModelForCausalLM.from_config(config, dtype=dtype), _TINY_SEED)
    return model.eval(), tokenizer


def _build_qwen3_06b_shape(dtype: torch.dtype) -> tuple[Any, Any]:
    # Qwen3-0.6B's shape, its full vocabulary included.
    return _build_qwen3_shape(dtype, vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)


def _build_qwen3_30m_shape(dtype: torch.dtype) -> tuple[Any, Any]:
    # Qwen3-0.6B's proportions scaled down: MLP 3x hidden, GQA group 2, head_dim 64, tied
    # embeddings; 10 layers of 3.1M parameters. The char vocabulary keeps the lm_head small, so
    # the decoder layers carry the cost.
    return _build_qwen3_shape(dtype, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)


PRESETS: dict[str, Callable[[torch.dtype], tuple[Any, Any]]] = {
    "tiny": _build_tiny,
    "tiny-hd32": _build_tiny_hd32,
    "qwen3-30m-shape": _build_qwen3_30m_shape,
    "qwen3-0.6b-shape": _build_qwen3_06b_shape,
}


def build_policy(name_or_path: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Build a causal LM and its tokenizer.

    Args:
        name_or_path: A preset name (``tiny``, ``tiny-hd32``, ``qwen3-30m-shape``, ``qwen3-0.6b-shape``) or a local Hugging Face
            directory with a config, safetensors weights and a tokenizer.
        dtype: Parameter dtype.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ValueError: ``name_or_path`` is neither a preset nor an existing directory.
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path](dtype)
    if not os.path.isdir(name_or_path):
        raise ValueError(
            f"Policy {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
            "Hugging Face model directory."
        )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, use_safetensors=True)
    return model.eval(), _load_tokenizer(name_or_path)


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a preset or a local Hugging Face directory, without building the model."""
    if name_or_path in PRESETS:
        tokenizer = build_char_tokenizer()
        if name_or_path in ("tiny", "tiny-hd32"):
            tokenizer.chat_template = TINY_CHAT_TEMPLATE
        return tokenizer
    if not os.path.isdir(name_or_path):
        raise ValueError(
            f"Policy {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
            "Hugging Face model directory."
        )
    return _load_tokenizer(name_or_path)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_path = os.path.join(path, "tokenizer_config.json")
    tokenizer_class = None
    if os.path.isfile(config_path):
        with open(config_path) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    # A generic tokenizer.json (like the tiny preset's char tokenizer) must be loaded as is:
    # AutoTokenizer would pick the model family's tokenizer class and replace its pre-tokenizer.
    if tokenizer_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def save_policy(model: Any, tokenizer: Any, path: str) -> str:
    """Save a policy as a Hugging Face directory (safetensors weights) that ``build_policy`` loads.

    Args:
        model: A ``PreTrainedModel``.
        tokenizer: Its tokenizer.
        path: Target directory (created if needed).

    Returns:
        ``path``.
    """
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def policy_skeleton(name: str, key: str) -> tuple[Any, Any]:
    """The policy ``name`` on the meta device (config, class, tensor names and shapes; no weights)
    and its tokenizer."""
    from lightning_fasync.errors import ConfigError

    if name in PRESETS:
        with torch.device("meta"):
            return PRESETS[name](torch.float32)
    if not os.path.isdir(name):
        raise ConfigError(f"`{key}` {name!r} is neither a preset ({', '.join(PRESETS)}) nor a local Hugging Face "
                          "model directory.")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return skeleton, load_tokenizer(name)
