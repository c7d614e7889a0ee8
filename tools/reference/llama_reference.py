#!/usr/bin/python3
"""Reference logits for kiln's Llama tests (tests/nn/test_llama_reference.cpp).

Runs Hugging Face's LlamaForCausalLM forward pass, re-implemented in plain torch line by line after
transformers' modeling_llama.py (transformers itself is not a dependency): RMSNorm in f32, rotate_half
rotary embeddings (with Llama 3 frequency scaling), grouped-query attention through repeat_kv, an additive
causal mask, softmax in f32, a SiLU-gated MLP, and a tied or untied lm_head. Everything runs in f32.

The weights are not stored anywhere: both this script and the C++ test generate them from the weight's
name and the element's index with the integer recipe below (docs/llama.md), so they agree bit for bit.

Usage: /usr/bin/python3 tools/reference/llama_reference.py [output_dir]   (default tests/data)
Writes llama_reference_<name>.json for each config in CONFIGS.
"""
import json
import math
import os
import sys

import torch

MASK64 = (1 << 64) - 1

# A tiny model in three variants: Llama 3 (rope scaling, tied embeddings), Llama 2 style (untied), and
# Qwen2 style (bias on q, k, v). original_max_position_embeddings is small so that the scaling's three
# frequency bands (kept, interpolated, divided) all occur with head_dim 16.
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=32, rope_scaling=None, tie_word_embeddings=False, attention_bias=False)
CONFIGS = {
    "llama3_tied": dict(BASE, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=256),
                        tie_word_embeddings=True),
    "untied": dict(BASE),
    "qkv_bias": dict(BASE, attention_bias=True),
}
TOKENS = [1, 17, 42, 99, 3, 127, 64]


# ---- weights: a pure function of (name, element index) ------------------------------------------
def fnv1a64(text):
    h = 0xCBF29CE484222325
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & MASK64
    return h


def splitmix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def weight_value(seed, index, is_norm):
    """k * 2^-26 with k a signed 24-bit integer: in [-0.125, 0.125), exact in f32. Norm weights add 1."""
    z = splitmix64((seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64)
    x = ((z >> 40) - (1 << 23)) * 2.0**-26
    return 1.0 + x if is_norm else x


def make_weight(name, shape):
    seed = fnv1a64(name)
    n = math.prod(shape)
    is_norm = name.endswith("norm.weight")
    values = [weight_value(seed, i, is_norm) for i in range(n)]
    # double -> f32 rounds to nearest even, as static_cast<float> does in C++.
    return torch.tensor(values, dtype=torch.float64).to(torch.float32).reshape(shape)


def state_dict(cfg):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": [nq, h], p + "self_attn.k_proj.weight": [nkv, h],
                       p + "self_attn.v_proj.weight": [nkv, h], p + "self_attn.o_proj.weight": [h, nq],
                       p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
                       p + "mlp.down_proj.weight": [h, i], p + "input_layernorm.weight": [h],
                       p + "post_attention_layernorm.weight": [h]})
        if cfg["attention_bias"]:
            shapes.update({p + "self_attn.q_proj.bias": [nq], p + "self_attn.k_proj.bias": [nkv],
                           p + "self_attn.v_proj.bias": [nkv]})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [v, h]
    return {name: make_weight(name, shape) for name, shape in shapes.items()}


# ---- LlamaForCausalLM, after transformers' modeling_llama.py -------------------------------------
def rms_norm(x, weight, eps):  # LlamaRMSNorm.forward
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def inv_freq(cfg):  # _compute_default_rope_parameters, then _compute_llama3_parameters
    dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    base = cfg["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg["rope_scaling"]
    if s is None:
        return inv
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_llama / factor + smooth_factor * inv_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_llama)


def rotary_cos_sin(cfg, position_ids):  # LlamaRotaryEmbedding.forward (attention_scaling is 1)
    inv = inv_freq(cfg)
    inv_expanded = inv[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    pos_expanded = position_ids[:, None, :].float()
    freqs = (inv_expanded.float() @ pos_expanded.float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden, n_rep):
    batch, n_kv, slen, head_dim = hidden.shape
    if n_rep == 1:
        return hidden
    hidden = hidden[:, :, None, :, :].expand(batch, n_kv, n_rep, slen, head_dim)
    return hidden.reshape(batch, n_kv * n_rep, slen, head_dim)


def linear(x, w, sd, prefix):
    b = sd.get(prefix + ".bias")
    return torch.nn.functional.linear(x, w, b)


def attention(cfg, sd, p, x, cos, sin, mask):  # LlamaAttention.forward + eager_attention_forward
    bsz, q_len, _ = x.shape
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    q = linear(x, sd[p + "q_proj.weight"], sd, p + "q_proj").view(bsz, q_len, -1, hd).transpose(1, 2)
    k = linear(x, sd[p + "k_proj.weight"], sd, p + "k_proj").view(bsz, q_len, -1, hd).transpose(1, 2)
    v = linear(x, sd[p + "v_proj.weight"], sd, p + "v_proj").view(bsz, q_len, -1, hd).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * cos) + (rotate_half(q) * sin)
    k = (k * cos) + (rotate_half(k) * sin)
    n_rep = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * hd**-0.5
    w = w + mask
    w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(w, v).transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
    return torch.nn.functional.linear(out, sd[p + "o_proj.weight"])


def mlp(sd, p, x):  # LlamaMLP.forward with hidden_act "silu"
    gate = torch.nn.functional.linear(x, sd[p + "gate_proj.weight"])
    up = torch.nn.functional.linear(x, sd[p + "up_proj.weight"])
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, sd[p + "down_proj.weight"])


def forward(cfg, sd, tokens):  # LlamaForCausalLM.forward, batch 1, no cache
    ids = torch.tensor([tokens], dtype=torch.int64)
    seq = ids.shape[1]
    h = torch.nn.functional.embedding(ids, sd["model.embed_tokens.weight"])
    position_ids = torch.arange(seq, dtype=torch.int64)[None, :]
    cos, sin = rotary_cos_sin(cfg, position_ids)
    min_value = torch.finfo(torch.float32).min
    mask = torch.triu(torch.full((seq, seq), min_value, dtype=torch.float32), diagonal=1)[None, None]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        residual = h
        h = rms_norm(h, sd[p + "input_layernorm.weight"], cfg["rms_norm_eps"])
        h = residual + attention(cfg, sd, p + "self_attn.", h, cos, sin, mask)
        residual = h
        h = rms_norm(h, sd[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        h = residual + mlp(sd, p + "mlp.", h)
    h = rms_norm(h, sd["model.norm.weight"], cfg["rms_norm_eps"])
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    return torch.nn.functional.linear(h, head).float()[0]  # [seq, vocab]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data")
    torch.set_num_threads(1)
    for name, cfg in CONFIGS.items():
        logits = forward(cfg, state_dict(cfg), TOKENS)
        doc = {
            "name": name,
            "generator": "tools/reference/llama_reference.py (Hugging Face LlamaForCausalLM in plain torch "
                         + torch.__version__ + ")",
            "config": cfg,
            "tokens": TOKENS,
            # 9 significant digits round-trip an f32 exactly.
            "logits": [[float(f"{v:.9g}") for v in row] for row in logits.tolist()],
        }
        path = os.path.join(out_dir, f"llama_reference_{name}.json")
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        print(f"{path}: logits {list(logits.shape)}, max |logit| {logits.abs().max().item():.4f}")


if __name__ == "__main__":
    main()
