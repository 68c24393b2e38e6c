"""Tiny but real Llama models, made in a second without network: safetensors (HF layout, with a
byte-level BPE tokenizer trained on the spot and a chat template) and its GGUF twin."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CORPUS = [
    "The fleet reconciles what the administrator wrote with what the machines report.",
    "Weights are pinned by digest and replicated from a peer that holds a verified copy.",
    "A cluster serves one model from several members on one port with shared settings.",
    "Hello! How can I help you today? I am a tiny model made for tests.",
    "The quick brown fox jumps over the lazy dog while the servers start in order.",
    "user assistant system: answer briefly and clearly, one sentence at a time.",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int = 4
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    context: int = 256
    vocab: int = 384
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _tokenizer(shape: Shape) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=shape.vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _weights(shape: Shape, vocab: int) -> dict[str, Any]:
    """HF Llama tensor names → float32 arrays, small random values (a deterministic seed)."""
    import numpy as np

    rng = np.random.default_rng(shape.seed)
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * shape.head_dim

    def rand(*dims: int) -> Any:
        return (rng.standard_normal(dims) * 0.05).astype(np.float32)

    w: dict[str, Any] = {"model.embed_tokens.weight": rand(vocab, h)}
    for n in range(shape.layers):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        w[p + "self_attn.q_proj.weight"] = rand(h, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, h)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
        w[p + "mlp.gate_proj.weight"] = rand(i, h)
        w[p + "mlp.up_proj.weight"] = rand(i, h)
        w[p + "mlp.down_proj.weight"] = rand(h, i)
    w["model.norm.weight"] = np.ones(h, dtype=np.float32)
    w["lm_head.weight"] = rand(vocab, h)
    return w


def make_safetensors(out: Path, shape: Shape = Shape()) -> Path:
    """An HF model directory: config.json, generation_config.json, tokenizer files, model.safetensors."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(shape)
    vocab = tok.get_vocab_size()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": shape.context, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False}, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "max_position_embeddings": shape.context, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>"),
        "fleet_test_shape": asdict(shape)}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>"),
        "do_sample": False}, indent=2))
    save_file(_weights(shape, vocab), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _permute(w: Any, n_head: int) -> Any:
    # llama.cpp's converter reorders Q and K rows for its rotary embedding layout.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_gguf(path: Path, shape: Shape = Shape(), omit: frozenset[str] = frozenset()) -> Path:
    """The same model as one GGUF file (arch llama, gpt2 tokenizer, f32 tensors); a tensor named in
    `omit` is left out (a well-formed file that llama.cpp refuses to load, as tests need)."""
    import logging

    import gguf

    logging.getLogger("gguf").setLevel(logging.WARNING)

    path.parent.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(shape)
    vocab = tok.get_vocab_size()
    tokens = [tok.id_to_token(i) for i in range(vocab)]
    specials = {tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")}
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w = _weights(shape, vocab)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("fleet-tiny-llama")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                            for i in range(vocab)])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.token_to_id("<s>"))
    writer.add_eos_token_id(tok.token_to_id("</s>"))
    writer.add_unk_token_id(tok.token_to_id("<unk>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, tensor: Any) -> None:
        if name not in omit:
            writer.add_tensor(name, tensor)

    add("token_embd.weight", w["model.embed_tokens.weight"])
    for n in range(shape.layers):
        p, b = f"model.layers.{n}.", f"blk.{n}."
        add(b + "attn_norm.weight", w[p + "input_layernorm.weight"])
        add(b + "attn_q.weight", _permute(w[p + "self_attn.q_proj.weight"], shape.heads))
        add(b + "attn_k.weight", _permute(w[p + "self_attn.k_proj.weight"], shape.kv_heads))
        add(b + "attn_v.weight", w[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", w[p + "self_attn.o_proj.weight"])
        add(b + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"])
        add(b + "ffn_gate.weight", w[p + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", w[p + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", w[p + "mlp.down_proj.weight"])
    add("output_norm.weight", w["model.norm.weight"])
    add("output.weight", w["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
