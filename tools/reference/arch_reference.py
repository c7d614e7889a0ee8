#!/usr/bin/python3
"""Reference logits for kiln's architecture tests (tests/nn/test_arch_reference.cpp).

Each architecture's forward pass re-implemented in plain torch after transformers' modeling files
(transformers itself is not a dependency), on llama_reference.py's Llama math and hashed weights:
  Mistral       modeling_mistral.py: sliding-window attention on every layer
  Qwen2         modeling_qwen2.py: q/k/v biases; use_sliding_window from layer max_window_layers on
  Qwen3         modeling_qwen3.py: RMSNorm of each head's q and k (q_norm, k_norm) before RoPE, head_dim
  Gemma2        modeling_gemma2.py: embeddings * sqrt(hidden), RMSNorm * (1 + w), four norms a layer,
                GeGLU (tanh), query_pre_attn_scalar, attention and final logit soft-capping, even layers
                sliding
  Gemma3 text   modeling_gemma3.py: Gemma2's without soft-capping, q/k norms, every
                sliding_window_pattern-th layer global (rope_theta, linear scaling), the others local
                (rope_local_base_freq)
  Phi3          modeling_phi3.py: fused qkv_proj and gate_up_proj, partial rotary, sliding window
  SmolLM        LlamaForCausalLM with tied embeddings and 3 heads over 1 kv head
Each config is written as the config.json a checkpoint carries, so the C++ test also parses it with
load_model_info. Sequences are longer than the windows, so the windows matter. Everything runs in f32.

Usage: /usr/bin/python3 tools/reference/arch_reference.py [output_dir]   (default tests/data)
Writes arch_reference_<name>.json for each config in CONFIGS.
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_reference as L  # noqa: E402  (the hashed weights, rotate_half, repeat_kv)

F = torch.nn.functional

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
            tie_word_embeddings=False, torch_dtype="float32")
CONFIGS = {
    "mistral_window": dict(BASE, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4),
    "qwen2_window": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
                         sliding_window=4, max_window_layers=1),
    "qwen3": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=24, rms_norm_eps=1e-6,
                  attention_bias=False),
    "gemma2": dict(BASE, architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16, rms_norm_eps=1e-6,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=4,
                   attn_logit_softcapping=0.25, final_logit_softcapping=3.0, tie_word_embeddings=True),
    "gemma3": dict(BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=3,
                   head_dim=16, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16,
                   sliding_window=4, sliding_window_pattern=3, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   rope_scaling=dict(rope_type="linear", factor=8.0), final_logit_softcapping=None,
                   attn_logit_softcapping=None, tie_word_embeddings=True),
    "phi3": dict(BASE, architectures=["Phi3ForCausalLM"], model_type="phi3", partial_rotary_factor=0.5,
                 sliding_window=5, hidden_act="silu"),
    "smollm": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=48,
                   num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=True),
}
TOKENS = [1, 17, 42, 99, 3, 127, 64, 8, 77, 23, 100, 5]


def arch(cfg):
    return cfg["model_type"]


def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def gemma(cfg):
    return arch(cfg) in ("gemma2", "gemma3_text")


def sliding(cfg, layer):  # each architecture's layer_types rule
    a = arch(cfg)
    if a in ("mistral", "phi3"):
        return cfg.get("sliding_window") is not None
    if a == "qwen2":
        return cfg.get("use_sliding_window", False) and layer >= cfg["max_window_layers"]
    if a == "gemma2":
        return bool((layer + 1) % 2)
    if a == "gemma3_text":
        return bool((layer + 1) % cfg["sliding_window_pattern"])
    return False


def state_dict(cfg):
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = head_dim(cfg)
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.o_proj.weight": [h, nq], p + "mlp.down_proj.weight": [h, i],
                       p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h]})
        if arch(cfg) == "phi3":
            shapes.update({p + "self_attn.qkv_proj.weight": [nq + 2 * nkv, h], p + "mlp.gate_up_proj.weight": [2 * i, h]})
        else:
            shapes.update({p + "self_attn.q_proj.weight": [nq, h], p + "self_attn.k_proj.weight": [nkv, h],
                           p + "self_attn.v_proj.weight": [nkv, h], p + "mlp.gate_proj.weight": [i, h],
                           p + "mlp.up_proj.weight": [i, h]})
        if arch(cfg) == "qwen2":
            shapes.update({p + "self_attn.q_proj.bias": [nq], p + "self_attn.k_proj.bias": [nkv],
                           p + "self_attn.v_proj.bias": [nkv]})
        if arch(cfg) in ("qwen3", "gemma3_text"):
            shapes.update({p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]})
        if gemma(cfg):
            shapes.update({p + "pre_feedforward_layernorm.weight": [h], p + "post_feedforward_layernorm.weight": [h]})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [v, h]
    return {name: L.make_weight(name, shape) for name, shape in shapes.items()}


def rms_norm(cfg, x, weight):
    if gemma(cfg):  # Gemma2RMSNorm / Gemma3RMSNorm: computed in f32, scaled by (1 + weight)
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
        return (out * (1.0 + weight.float())).type_as(x)
    return L.rms_norm(x, weight, cfg["rms_norm_eps"])


def rotary(cfg, position_ids, local):  # the default / linear rope, over the rotated dims
    dim = int(head_dim(cfg) * cfg.get("partial_rotary_factor", 1.0))
    base = cfg["rope_local_base_freq"] if local else cfg["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.get("rope_scaling")
    if scaling and not local and scaling["rope_type"] == "linear":
        inv = inv / scaling["factor"]
    inv_expanded = inv[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    freqs = (inv_expanded.float() @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):  # apply_rotary_pos_emb, with Phi-3's partial rotary split
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((x_rot * cos) + (L.rotate_half(x_rot) * sin), x_pass), dim=-1)


def attention(cfg, sd, p, x, cos, sin, mask):
    bsz, q_len, _ = x.shape
    hd = head_dim(cfg)
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    if arch(cfg) == "phi3":
        qkv = F.linear(x, sd[p + "qkv_proj.weight"])
        q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:
        q = L.linear(x, sd[p + "q_proj.weight"], sd, p + "q_proj")
        k = L.linear(x, sd[p + "k_proj.weight"], sd, p + "k_proj")
        v = L.linear(x, sd[p + "v_proj.weight"], sd, p + "v_proj")
    q, k, v = (t.view(bsz, q_len, -1, hd) for t in (q, k, v))
    if arch(cfg) in ("qwen3", "gemma3_text"):
        q = rms_norm(cfg, q, sd[p + "q_norm.weight"])
        k = rms_norm(cfg, k, sd[p + "k_norm.weight"])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    n_rep = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    k, v = L.repeat_kv(k, n_rep), L.repeat_kv(v, n_rep)
    scaling = cfg["query_pre_attn_scalar"] ** -0.5 if gemma(cfg) else hd ** -0.5
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    cap = cfg.get("attn_logit_softcapping")
    if cap is not None:  # Gemma 2's eager_attention_forward: before the mask
        w = torch.tanh(w / cap) * cap
    w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(w, v).transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
    return F.linear(out, sd[p + "o_proj.weight"])


def mlp(cfg, sd, p, x):
    if arch(cfg) == "phi3":  # Phi3MLP: gate first, up second
        gate, up = F.linear(x, sd[p + "gate_up_proj.weight"]).chunk(2, dim=-1)
    else:
        gate, up = F.linear(x, sd[p + "gate_proj.weight"]), F.linear(x, sd[p + "up_proj.weight"])
    act = F.gelu(gate, approximate="tanh") if gemma(cfg) else F.silu(gate)
    return F.linear(act * up, sd[p + "down_proj.weight"])


def masks(cfg, seq):
    """Additive masks: causal, and causal within the window (key j visible from i iff i - j < window)."""
    i = torch.arange(seq)[:, None]
    j = torch.arange(seq)[None, :]
    min_value = torch.finfo(torch.float32).min
    causal = torch.where(j <= i, 0.0, min_value)[None, None]
    window = cfg.get("sliding_window")
    windowed = causal if window is None else torch.where((j <= i) & (i - j < window), 0.0, min_value)[None, None]
    return causal, windowed


def forward(cfg, sd, tokens):
    ids = torch.tensor([tokens], dtype=torch.int64)
    seq = ids.shape[1]
    h = F.embedding(ids, sd["model.embed_tokens.weight"])
    if gemma(cfg):
        h = h * torch.tensor(cfg["hidden_size"] ** 0.5, dtype=h.dtype)
    position_ids = torch.arange(seq, dtype=torch.int64)[None, :]
    global_rope = rotary(cfg, position_ids, local=False)
    local_rope = rotary(cfg, position_ids, local=True) if "rope_local_base_freq" in cfg else global_rope
    causal, windowed = masks(cfg, seq)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        is_sliding = sliding(cfg, layer)
        cos, sin = local_rope if is_sliding else global_rope
        mask = windowed if is_sliding else causal
        residual = h
        h = rms_norm(cfg, h, sd[p + "input_layernorm.weight"])
        h = attention(cfg, sd, p + "self_attn.", h, cos, sin, mask)
        if gemma(cfg):
            h = rms_norm(cfg, h, sd[p + "post_attention_layernorm.weight"])
            h = residual + h
            residual = h
            h = rms_norm(cfg, h, sd[p + "pre_feedforward_layernorm.weight"])
            h = mlp(cfg, sd, p + "mlp.", h)
            h = rms_norm(cfg, h, sd[p + "post_feedforward_layernorm.weight"])
        else:
            h = residual + h
            residual = h
            h = rms_norm(cfg, h, sd[p + "post_attention_layernorm.weight"])
            h = mlp(cfg, sd, p + "mlp.", h)
        h = residual + h
    h = rms_norm(cfg, h, sd["model.norm.weight"])
    head = sd["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else sd["lm_head.weight"]
    logits = F.linear(h, head)
    cap = cfg.get("final_logit_softcapping")
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()[0]  # [seq, vocab]


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data")
    torch.set_num_threads(1)
    for name, cfg in CONFIGS.items():
        sd = state_dict(cfg)
        logits = forward(cfg, sd, TOKENS)
        doc = {
            "name": name,
            "generator": "tools/reference/arch_reference.py (Hugging Face " + cfg["architectures"][0]
                         + " in plain torch " + torch.__version__ + ")",
            "config": cfg,
            "tokens": TOKENS,
            "logits": [[float(f"{v:.9g}") for v in row] for row in logits.tolist()],
        }
        path = os.path.join(out_dir, f"arch_reference_{name}.json")
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        # How much the window changes the logits (0 would mean the test cannot see it).
        note = ""
        if cfg.get("sliding_window") is not None:
            full = forward(dict(cfg, sliding_window=None), sd, TOKENS)
            note = f", window changes logits by {(full - logits).abs().max().item():.4f}"
        print(f"{path}: logits {list(logits.shape)}, max |logit| {logits.abs().max().item():.4f}{note}")


if __name__ == "__main__":
    main()
