"""Build a small Llama-architecture model directory that vLLM can serve, offline and deterministically.

No model hub is reachable from the machines kvscope is developed and tested on, and prefix-cache behaviour
does not depend on what the weights say, so kvscope builds its own model: a byte-level BPE tokenizer trained
on generated agent-like text, a Llama-3-style chat template, a GQA `config.json` with head_dim 64 (supported
by both vLLM's CPU attention and GPU FlashAttention) and seeded random weights in safetensors.

``tokenizer="tekken"`` builds the same architecture on a production tokenizer instead: Mistral's Tekken
(131,072 tokens), shipped in the data folder of ``mistral_common``, which vLLM depends on, so it is present
wherever vLLM is and needs no download. The generated-text BPE tokenizes real transcripts very differently from any
real model; Tekken gives recorded and imported traffic realistic token counts and block boundaries. It
is converted to a Hugging Face ``tokenizer.json`` (transformers' Mistral converter; the ids equal
mistral_common's own), with a Mistral-style chat template made of Tekken's control tokens. Only the
embedding grows (tied with the output layer to keep the file small); the KV cache per token is set by layers
and heads and does not change.

Same seed and options give byte-identical files (numpy's PCG64 drives every random choice; tokenizer
training runs single-threaded). The weights are random unless ``train_steps`` > 0, and ``kvscope_model.json``
says which: everything that reports speculative-decoding acceptance reads that flag, because greedy decoding
with random weights repeats itself and makes n-gram drafts look almost always accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvscope.workloads.corpus import generate_corpus

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]
BOS, EOS, HEADER_START, HEADER_END, EOT, PAD = SPECIAL_TOKENS

# Llama-3 layout; `{% generation %}`-free so it renders with plain jinja2 as well as transformers.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Mistral layout on Tekken's control tokens; each message's content appears exactly once (text mode splits
# renderings into template and content segments).
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}"
    "{%- else %}{{- '[INST]' + message['content'] + '[/INST]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

#: Production tokenizers in mistral_common's data folder: ``--tokenizer`` name → file.
PRODUCTION_TOKENIZERS = {"tekken": "tekken_240911.json", "tekken-240718": "tekken_240718.json"}
#: ``trained``: the byte-level BPE trained on generated agent-like text (the default).
TOKENIZER_CHOICES = ("trained", *PRODUCTION_TOKENIZERS)

MODEL_CARD_FILE = "kvscope_model.json"


@dataclass(frozen=True)
class TinyModelShape:
    """Architecture of the built model; the defaults give ≈5 M parameters and 2 KiB of KV per token (bf16)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads (GQA)")
        if self.vocab_size < 4000 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must be at least 4,006 (≥ 4,000 learned tokens plus specials)")

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + lm_head

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


#: ``--size``: named shapes on the same tokenizer (same seed, same vocabulary), so model routing can serve a small
#: and a larger model side by side on one trace. ``large`` doubles the layers, the width and the heads (≈8x the
#: non-embedding parameters, 4x the KV bytes per token): a real step up in prefill and decode cost, while its
#: weights stay tens of MB and build in seconds on a CPU.
MODEL_SIZES: dict[str, TinyModelShape] = {
    "small": TinyModelShape(),
    "large": TinyModelShape(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4),
}


@dataclass
class BuildInfo:
    seed: int
    shape: TinyModelShape
    weights: str  # "random" or "trained"
    train_steps: int
    corpus_chars: int
    num_parameters: int
    files: dict[str, str] = field(default_factory=dict)  # name -> sha256
    tokenizer: str = "trained"  # TOKENIZER_CHOICES
    size: str | None = None  # a MODEL_SIZES name, or None for a custom shape


# -------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus: str, vocab_size: int):
    """Byte-level BPE trained offline; single-threaded so that merges (and the file) are reproducible."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # deferred: tokenizers is heavy, only tokenizing needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.split("\n")
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tokenizer


def production_tokenizer(name: str):
    """A production tokenizer of mistral_common's data folder as a ``tokenizers.Tokenizer`` (its ids are
    mistral_common's own)."""
    if name not in PRODUCTION_TOKENIZERS:
        raise ValueError(f"tokenizer {name!r}: one of {', '.join(TOKENIZER_CHOICES)}")
    try:
        import mistral_common  # optional: mistral_common may be absent, the ImportError is handled
        # optional: transformers may be absent, the ImportError is handled
        from transformers.integrations.mistral.tokenizer import MistralConverter
    except ImportError as exc:
        raise ValueError(f"tokenizer {name!r} needs mistral_common and transformers (installed with vLLM): "
                         f"{exc}") from None
    path = Path(mistral_common.__file__).parent / "data" / PRODUCTION_TOKENIZERS[name]
    if not path.is_file():
        raise ValueError(f"tokenizer {name!r}: {path} is not there (mistral_common {mistral_common.__version__})")
    return MistralConverter(vocab_file=str(path), add_prefix_space=False).converted()


# ---------------------------------------------------------------------------------------------- weights


def init_weights(shape: TinyModelShape, seed: int) -> dict[str, np.ndarray]:
    """HF Llama parameter names with normal(0, 0.02) matrices and unit norms, from a PCG64 stream."""
    rng = np.random.default_rng(seed + 1_000_003)
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(v, h)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.q_proj.weight"] = mat(q, h)
        tensors[p + "self_attn.k_proj.weight"] = mat(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = mat(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = mat(h, q)
        tensors[p + "mlp.gate_proj.weight"] = mat(i, h)
        tensors[p + "mlp.up_proj.weight"] = mat(i, h)
        tensors[p + "mlp.down_proj.weight"] = mat(h, i)
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    if not shape.tie_word_embeddings:
        tensors["lm_head.weight"] = mat(v, h)
    return tensors


def train_weights(
    tensors: dict[str, np.ndarray],
    shape: TinyModelShape,
    token_ids: np.ndarray,
    steps: int,
    seed: int,
    seq_len: int = 128,
    batch_size: int = 16,
    lr: float = 3e-3,
) -> tuple[dict[str, np.ndarray], list[float]]:
    """A few hundred AdamW steps on the corpus so greedy output is not a loop (makes n-gram acceptance meaningful).

    Needs torch (installed with vLLM). Single-threaded, deterministic algorithms: same inputs, same bytes.
    """
    import torch  # deferred: torch is heavy, only building the tiny model needs it

    # deferred: it loads torch, tqdm, which importing this module must not
    from kvscope.harness.model._llama_torch import TinyLlama

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        model = TinyLlama(shape)
        model.load_numpy(tensors)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        rng = np.random.default_rng(seed + 7)
        data = torch.from_numpy(token_ids.astype(np.int64))
        losses: list[float] = []
        for step in range(steps):
            starts = rng.integers(0, len(token_ids) - seq_len - 1, size=batch_size)
            batch = torch.stack([data[s : s + seq_len + 1] for s in starts])
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, shape.vocab_size), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / 20)
            opt.step()
            losses.append(float(loss.detach()))
        return model.export_numpy(), losses
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)


def _write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """bf16 safetensors (vLLM's CPU dtype); fixed metadata so the file is byte-identical across runs."""
    import torch  # deferred: torch is heavy, only building the tiny model needs it
    # deferred: safetensors is heavy, only building the tiny model needs it
    from safetensors.torch import save_file

    torch_tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16) for k, v in sorted(tensors.items())}
    save_file(torch_tensors, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------- builder


def _config_json(shape: TinyModelShape, bos_id: int, eos_ids: list[int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "pad_token_id": None,
        "use_cache": True,
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_hf_files(tmp: Path, tokenizer: Any, shape: TinyModelShape, bos_id: int, eos_ids: list[int],
                    specials: tuple[str, str, str] = (BOS, EOT, PAD), chat_template: str = CHAT_TEMPLATE) -> None:
    """Tokenizer, tokenizer config, chat template and model configs, as Hugging Face loaders expect them."""
    bos, eos, pad = specials
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": bos,
                "eos_token": eos,
                "pad_token": pad,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": shape.max_position_embeddings,
                "chat_template": chat_template,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    (tmp / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "pad_token": pad}, indent=2, sort_keys=True) + "\n"
    )
    (tmp / "chat_template.jinja").write_text(chat_template + "\n")
    (tmp / "config.json").write_text(json.dumps(_config_json(shape, bos_id, eos_ids), indent=2) + "\n")
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_ids, "do_sample": False}, indent=2) + "\n"
    )


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    shape: TinyModelShape | None = None,
    train_steps: int = 0,
    corpus_chars: int = 1_500_000,
    overwrite: bool = True,
    tokenizer: str = "trained",
    size: str | None = None,
) -> BuildInfo:
    """Write the model directory; returns what was built (also saved as ``kvscope_model.json``).
    ``tokenizer``: ``trained`` (BPE trained on generated text) or a production one (:data:`PRODUCTION_TOKENIZERS`).
    ``size``: a named shape (:data:`MODEL_SIZES`) instead of ``shape``; the tokenizer depends on the seed only,
    so two sizes built with one seed share it token for token."""
    if size is not None:
        if shape is not None:
            raise ValueError("give size or shape, not both")
        if size not in MODEL_SIZES:
            raise ValueError(f"size {size!r}: one of {', '.join(MODEL_SIZES)}")
        shape = MODEL_SIZES[size]
    shape = shape or TinyModelShape()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    if tokenizer == "trained":
        corpus = generate_corpus(seed, corpus_chars)
        tok = train_tokenizer(corpus, shape.vocab_size)
        if tok.get_vocab_size() != shape.vocab_size:
            raise RuntimeError(
                f"tokenizer learned {tok.get_vocab_size()} tokens, wanted {shape.vocab_size}: corpus too small"
            )
        specials, template = (BOS, EOT, PAD), CHAT_TEMPLATE
        bos_id = tok.token_to_id(BOS)
        eos_ids = [tok.token_to_id(EOS), tok.token_to_id(EOT)]
    else:
        if train_steps > 0:  # 131k-way logits: a training step costs ~16x the default model's memory and time
            raise ValueError(f"--train-steps with --tokenizer {tokenizer}: training is only offered for the "
                             "trained tokenizer's 8,192-token model")
        tok = production_tokenizer(tokenizer)
        corpus, corpus_chars = "", 0
        shape = replace(shape, vocab_size=tok.get_vocab_size(), tie_word_embeddings=True)
        specials, template = ("<s>", "</s>", "<pad>"), MISTRAL_CHAT_TEMPLATE
        bos_id = tok.token_to_id("<s>")
        eos_ids = [tok.token_to_id("</s>")]

    tensors = init_weights(shape, seed)
    losses: list[float] = []
    if train_steps > 0:
        ids = np.array(tok.encode(corpus).ids, dtype=np.int32)
        tensors, losses = train_weights(tensors, shape, ids, train_steps, seed)

    # Write into a temporary sibling then rename, so a half-built directory is never served.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tinymodel-", dir=out.parent))
    try:
        _write_hf_files(tmp, tok, shape, bos_id, eos_ids, specials, template)
        _write_safetensors(tensors, tmp / "model.safetensors")
        info = BuildInfo(
            seed=seed,
            shape=shape,
            weights="trained" if train_steps > 0 else "random",
            train_steps=train_steps,
            corpus_chars=corpus_chars,
            num_parameters=shape.num_parameters(),
            tokenizer=tokenizer,
            size=size,
        )
        for f in sorted(tmp.iterdir()):
            info.files[f.name] = _sha256(f)
        card = asdict(info)
        card["final_train_loss"] = round(losses[-1], 4) if losses else None
        card["kv_bytes_per_token_bf16"] = shape.kv_bytes_per_token(2)
        (tmp / MODEL_CARD_FILE).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def read_model_card(model_dir: str | Path) -> dict | None:
    """The build record of a kvscope-built model, or None for any other model (e.g. a hub checkpoint)."""
    path = Path(model_dir) / MODEL_CARD_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def weights_are_random(model_dir: str | Path) -> bool:
    card = read_model_card(model_dir)
    return bool(card and card.get("weights") == "random")
