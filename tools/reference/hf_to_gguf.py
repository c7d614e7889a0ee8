"""Write a Hugging Face Llama directory (config.json, model.safetensors, tokenizer.json) as one GGUF v3
file, the way llama.cpp's convert_hf_to_gguf.py does: its metadata keys, its tensor names, the Q/K row
permutation that turns Hugging Face's rotate-half RoPE into llama.cpp's interleaved one, Q8_0 and Q4_0
blocks as ggml quantizes them, and the byte-level BPE tokenizer as a "gpt2" vocabulary with merges.

The test oracle for kiln's GGUF loader: written independently of kiln, in plain Python (no numpy), so
that a model read from the GGUF file must give the logits of the same model read from safetensors.
Usage: python3 tools/reference/hf_to_gguf.py MODEL_DIR OUT.gguf [--type f32|f16|q8_0|q4_0|q4_0_mixed]
q4_0_mixed: Q4_0 with token_embd and each layer's attn_v in Q8_0, a mix in one file as llama.cpp's
"_M" types keep some matrices at more bits.
"""
import argparse
import json
import math
import os
import struct
import sys
from array import array

GGUF_MAGIC = b"GGUF"
ALIGNMENT = 32
# gguf_type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
# ggml_type ids
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q8_0 = 0, 1, 2, 8
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        raw = data[begin:end]
        if e["dtype"] == "F32":
            values = array("f", raw)
        elif e["dtype"] == "F16":
            values = array("f", struct.unpack(f"<{len(raw) // 2}e", raw))
        elif e["dtype"] == "BF16":
            values = array("f", struct.unpack(f"<{len(raw) // 2}f", b"".join(b"\0\0" + raw[i:i + 2] for i in range(0, len(raw), 2))))
        else:
            sys.exit(f"{path}: tensor {name}: dtype {e['dtype']} is not a float dtype")
        if sys.byteorder != "little":
            values.byteswap()
        tensors[name] = (e["shape"], values)
    return tensors


def permute(values, shape, n_head):
    """convert_hf_to_gguf's LlamaModel.permute: w.reshape(n_head, 2, rows/n_head/2, cols)
    .swapaxes(1, 2).reshape(rows, cols), on a row-major [rows, cols] list."""
    rows, cols = shape
    half = rows // n_head // 2
    out = array("f", bytes(4 * rows * cols))
    for h in range(n_head):
        for i in range(half):
            for j in range(2):
                src = h * 2 * half + j * half + i  # row (h, j, i) of the [n_head, 2, half] view
                dst = h * 2 * half + i * 2 + j     # lands at (h, i, j)
                out[dst * cols:(dst + 1) * cols] = values[src * cols:(src + 1) * cols]
    return out


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def quantize_q8_0(values, cols):
    """ggml's quantize_row_q8_0_ref: per 32 weights d = amax / 127 (f32), q = roundf(x * (1/d))."""
    out = bytearray()
    for b in range(0, len(values), 32):
        block = values[b:b + 32]
        amax = max(abs(v) for v in block)
        d = f32(amax / 127.0)
        inv = f32(1.0 / d) if d else 0.0
        qs = []
        for v in block:
            t = f32(v * inv)
            qs.append(int(math.floor(abs(t) + 0.5)) * (1 if t >= 0 else -1))  # roundf: half away from 0
        out += struct.pack("<e", d) + struct.pack("<32b", *qs)
    return bytes(out)


def quantize_q4_0(values, cols):
    """ggml's quantize_row_q4_0_ref: per 32 weights, d = (the value of largest magnitude) / -8,
    q = min(15, (int8)(x * (1/d) + 8.5)); byte j holds weights j (low nibble) and j + 16."""
    out = bytearray()
    for b in range(0, len(values), 32):
        block = values[b:b + 32]
        amax, vmax = 0.0, 0.0
        for v in block:
            if abs(v) > amax:
                amax, vmax = abs(v), v
        d = f32(vmax / -8.0)
        inv = f32(1.0 / d) if d else 0.0
        q = [min(15, int(f32(f32(v * inv) + 8.5))) for v in block]  # the cast truncates; x + 8.5 > 0
        out += struct.pack("<e", d) + bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    return bytes(out)


class Writer:
    def __init__(self):
        self.kv = bytearray()
        self.n_kv = 0
        self.infos = bytearray()
        self.data = bytearray()
        self.n_tensors = 0

    @staticmethod
    def string(s):
        b = s.encode("utf-8") if isinstance(s, str) else s
        return struct.pack("<Q", len(b)) + b

    def add(self, key, vtype, value):
        self.kv += self.string(key) + struct.pack("<I", vtype) + self.value(vtype, value)
        self.n_kv += 1

    def value(self, vtype, value):
        fmt = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q",
               I64: "q", F64: "d"}
        if vtype == STRING:
            return self.string(value)
        return struct.pack("<" + fmt[vtype], value)

    def add_array(self, key, etype, values):
        body = b"".join(self.value(etype, v) for v in values)
        self.kv += self.string(key) + struct.pack("<IIQ", ARRAY, etype, len(values)) + body
        self.n_kv += 1

    def add_tensor(self, name, shape, ggml_type, raw):
        while len(self.data) % ALIGNMENT:
            self.data.append(0)
        dims = list(reversed(shape))  # ggml order: innermost first
        self.infos += self.string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        self.infos += struct.pack("<IQ", ggml_type, len(self.data))
        self.data += raw
        self.n_tensors += 1

    def write(self, path):
        head = GGUF_MAGIC + struct.pack("<IQQ", 3, self.n_tensors, self.n_kv) + self.kv + self.infos
        pad = (-len(head)) % ALIGNMENT
        with open(path, "wb") as f:
            f.write(head + b"\0" * pad + self.data)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--type", choices=["f32", "f16", "q8_0", "q4_0", "q4_0_mixed"], default="f32")
    args = ap.parse_args()
    cfg = json.load(open(os.path.join(args.model_dir, "config.json")))
    if cfg.get("architectures", ["LlamaForCausalLM"])[0] != "LlamaForCausalLM":
        sys.exit("hf_to_gguf.py writes Llama models only")
    tensors = read_safetensors(os.path.join(args.model_dir, "model.safetensors"))
    tok = json.load(open(os.path.join(args.model_dir, "tokenizer.json")))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = Writer()
    w.add("general.architecture", STRING, "llama")
    w.add("general.name", STRING, os.path.basename(os.path.normpath(args.model_dir)))
    w.add("general.alignment", U32, ALIGNMENT)
    w.add("general.file_type", U32, {"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2, "q4_0_mixed": 2}[args.type])
    w.add("llama.context_length", U32, cfg["max_position_embeddings"])
    w.add("llama.embedding_length", U32, cfg["hidden_size"])
    w.add("llama.block_count", U32, cfg["num_hidden_layers"])
    w.add("llama.feed_forward_length", U32, cfg["intermediate_size"])
    w.add("llama.attention.head_count", U32, heads)
    w.add("llama.attention.head_count_kv", U32, kv_heads)
    w.add("llama.attention.key_length", U32, head_dim)
    w.add("llama.attention.value_length", U32, head_dim)
    w.add("llama.rope.dimension_count", U32, head_dim)
    w.add("llama.rope.freq_base", F32, cfg.get("rope_theta", 10000.0))
    w.add("llama.attention.layer_norm_rms_epsilon", F32, cfg["rms_norm_eps"])
    w.add("llama.vocab_size", U32, cfg["vocab_size"])

    # The byte-level BPE vocabulary, as convert_hf_to_gguf's _set_vocab_gpt2 writes it.
    vocab = tok["model"]["vocab"]
    tokens = [""] * cfg["vocab_size"]
    types = [TOKEN_NORMAL] * cfg["vocab_size"]
    for piece, i in vocab.items():
        tokens[i] = piece
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = TOKEN_CONTROL if added["special"] else 4
    for i, t in enumerate(tokens):
        if not t:
            tokens[i], types[i] = f"[PAD{i}]", 5  # ids no piece names: UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add("tokenizer.ggml.model", STRING, "gpt2")
    w.add("tokenizer.ggml.pre", STRING, "gpt-2")
    w.add_array("tokenizer.ggml.tokens", STRING, tokens)
    w.add_array("tokenizer.ggml.token_type", I32, types)
    w.add_array("tokenizer.ggml.merges", STRING, merges)
    w.add("tokenizer.ggml.bos_token_id", U32, cfg["bos_token_id"])
    w.add("tokenizer.ggml.eos_token_id", U32, cfg["eos_token_id"])
    w.add("tokenizer.ggml.add_bos_token", BOOL, tok.get("post_processor") is not None)
    template = os.path.join(args.model_dir, "chat_template.jinja")
    if os.path.exists(template):
        w.add("tokenizer.chat_template", STRING, open(template).read())

    def put(name, hf_name, permute_heads=None):
        shape, values = tensors[hf_name]
        if permute_heads:
            values = permute(values, shape, permute_heads)
        kind = args.type
        if kind == "q4_0_mixed":
            kind = "q8_0" if name == "token_embd.weight" or name.endswith("attn_v.weight") else "q4_0"
        if len(shape) == 1 or kind == "f32":
            w.add_tensor(name, shape, GGML_F32, values.tobytes())
        elif kind == "f16" or shape[-1] % 32:
            w.add_tensor(name, shape, GGML_F16, struct.pack(f"<{len(values)}e", *values))
        elif kind == "q8_0":
            w.add_tensor(name, shape, GGML_Q8_0, quantize_q8_0(values, shape[-1]))
        else:
            w.add_tensor(name, shape, GGML_Q4_0, quantize_q4_0(values, shape[-1]))

    put("token_embd.weight", "model.embed_tokens.weight")
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", p + "input_layernorm.weight")
        put(b + "attn_q.weight", p + "self_attn.q_proj.weight", heads)
        put(b + "attn_k.weight", p + "self_attn.k_proj.weight", kv_heads)
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight")
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight")
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        put(b + "ffn_gate.weight", p + "mlp.gate_proj.weight")
        put(b + "ffn_up.weight", p + "mlp.up_proj.weight")
        put(b + "ffn_down.weight", p + "mlp.down_proj.weight")
    # Llama 3.1's rope scaling, as llama.cpp's converter writes it: a divisor per rotary frequency.
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        base, factor = cfg.get("rope_theta", 10000.0), scaling.get("factor", 8.0)
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        factors = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * base ** (i / head_dim)
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor("rope_freqs.weight", [len(factors)], GGML_F32, struct.pack(f"<{len(factors)}f", *factors))
    put("output_norm.weight", "model.norm.weight")
    if not cfg.get("tie_word_embeddings", False):
        put("output.weight", "lm_head.weight")
    w.write(args.out)


if __name__ == "__main__":
    main()
