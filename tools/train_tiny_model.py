#!/usr/bin/python3
"""Trains kiln's embedded default model, models/kiln-tiny: a ~1M-parameter Llama on Debian's fortunes.

Everything is made here from scratch with plain torch (Debian's python3-torch; no transformers, no
tokenizers library, no downloads):
  1. corpus: the fortune files of the `fortunes` package (/usr/share/games/fortunes, BSD licensed),
     a subset listed in CORPUS_FILES; fortunes are separated by lines holding only "%";
  2. tokenizer: GPT-2 style byte-level BPE learned on that corpus (tools/reference/byte_level_bpe.py
     holds the pre-tokenizer and the byte table), written as a Hugging Face tokenizer.json;
  3. model: a LlamaForCausalLM (RMSNorm, rotate_half RoPE, grouped-query attention, SwiGLU MLP, tied
     embeddings) trained on the fortunes, each one as <|bos|> text <|eos|>, packed into windows;
  4. files: model.safetensors (written by hand, f32, Hugging Face's tensor names), config.json,
     generation_config.json, tokenizer.json.

Training stops after --minutes of wall-clock time (the cosine schedule follows elapsed time, so the run
is reproducible in its data order but not bit for bit across machines of different speed).

Usage: /usr/bin/python3 tools/train_tiny_model.py [--minutes 20] [--out models/kiln-tiny]
Then refresh the test data: /usr/bin/python3 tools/reference/generate_reference.py
Debian's torch multiplies through libblas.so.3; netlib's reference BLAS is several times slower than
OpenBLAS (libopenblas0-pthread). docs/embedded-model.md has the exact command the committed model used.
"""
import argparse
import collections
import json
import math
import os
import random
import re
import struct
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
from byte_level_bpe import ByteLevelBPE, bytes_to_unicode, pre_tokenize  # noqa: E402

FORTUNE_DIR = "/usr/share/games/fortunes"
# Left out: ascii-art (pictures), translate-me (not English), zippy (deliberate nonsense), and ethnic and
# men-women (stereotype jokes: not what a newcomer's first run should print). The offensive `off/`
# folder is never read (it is not installed here; the list below is explicit anyway).
CORPUS_FILES = ["art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs", "education",
                "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux",
                "linuxcookie", "literature", "love", "magic", "medicine", "miscellaneous", "news",
                "paradoxum", "people", "perl", "pets", "platitudes", "politics", "pratchett", "riddles",
                "science", "songs-poems", "sports", "startrek", "tao", "wisdom", "work"]
BOS, EOS = "<|bos|>", "<|eos|>"


# ---- corpus -----------------------------------------------------------------------------------------
def read_fortunes(directory):
    fortunes = []
    for name in CORPUS_FILES:
        with open(os.path.join(directory, name), "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        # Overstriking ("_\bx" underlines, "x\bx" bolds) is terminal markup, not text.
        while "\b" in text:
            text = re.sub(r"[^\n]?\x08", "", text)
        text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
        for block in re.split(r"^%$", text, flags=re.M):
            lines = [line.rstrip() for line in block.split("\n")]
            fortune = "\n".join(lines).strip("\n")
            if fortune.strip():
                fortunes.append(fortune)
    return fortunes


# ---- byte-level BPE training ------------------------------------------------------------------------
def train_bpe(texts, num_merges):
    """Learns merges greedily by pair frequency (GPT-2 / Hugging Face BpeTrainer style); pairs never cross
    a pre-tokenizer piece. Returns the merges in order."""
    byte_encoder = bytes_to_unicode()
    piece_counts = collections.Counter()
    for text in texts:
        piece_counts.update(pre_tokenize(text))
    words = [[byte_encoder[b] for b in piece.encode("utf-8")] for piece in piece_counts]
    counts = list(piece_counts.values())

    pair_counts = collections.Counter()
    pair_words = collections.defaultdict(set)
    for w, (symbols, count) in enumerate(zip(words, counts)):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += count
            pair_words[pair].add(w)

    merges = []
    for _ in range(num_merges):
        if not pair_counts:
            break
        # Highest count wins; ties go to the lexicographically largest pair, so the result is stable.
        best = max(pair_counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        merged_symbol = best[0] + best[1]
        for w in list(pair_words[best]):
            symbols, count = words[w], counts[w]
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] -= count
                if pair_counts[pair] <= 0:
                    del pair_counts[pair]
            new_symbols = []
            k = 0
            while k < len(symbols):
                if k < len(symbols) - 1 and (symbols[k], symbols[k + 1]) == best:
                    new_symbols.append(merged_symbol)
                    k += 2
                else:
                    new_symbols.append(symbols[k])
                    k += 1
            words[w] = new_symbols
            for pair in zip(new_symbols, new_symbols[1:]):
                pair_counts[pair] += count
                pair_words[pair].add(w)
        pair_words.pop(best, None)
    return merges


def tokenizer_json(merges):
    byte_encoder = bytes_to_unicode()
    vocab = {byte_encoder[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bos_id, eos_id = len(vocab), len(vocab) + 1
    vocab[BOS], vocab[EOS] = bos_id, eos_id

    def added(content, token_id):
        return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True}

    bos_template = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [added(BOS, bos_id), added(EOS, eos_id)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos_template, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos_template, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


# ---- the model: LlamaForCausalLM, parameter names as Hugging Face's ------------------------------------
class RMSNorm(torch.nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.heads, self.kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.q_proj = torch.nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin, mask):
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)  # [b, heads, seq, hd]
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)  # [b, kv, seq, hd]
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)  # [b, heads, seq, hd], as Hugging Face's repeat_kv
        v = v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(2, 3)) * self.head_dim**-0.5 + mask  # [b, heads, seq, seq]
        out = torch.softmax(scores, dim=-1) @ v  # [b, heads, seq, hd]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = torch.nn.Linear(h, i, bias=False)
        self.up_proj = torch.nn.Linear(h, i, bias=False)
        self.down_proj = torch.nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        hd = cfg["head_dim"]
        inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=cfg["initializer_range"])
        # GPT-2's scaled init of the residual projections keeps early activations calm in a deep stack.
        for layer in self.model.layers:
            std = cfg["initializer_range"] / math.sqrt(2 * cfg["num_hidden_layers"])
            torch.nn.init.normal_(layer.self_attn.o_proj.weight, std=std)
            torch.nn.init.normal_(layer.mlp.down_proj.weight, std=std)

    def forward(self, ids):  # ids [batch, seq] -> logits [batch, seq, vocab]
        seq = ids.shape[1]
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [seq, head_dim]
        cos, sin = emb.cos(), emb.sin()
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.model.norm(x) @ self.model.embed_tokens.weight.t()  # tied lm_head


# ---- files --------------------------------------------------------------------------------------------
def write_safetensors(path, tensors):
    """safetensors: u64 little-endian header length, a JSON header, then the raw little-endian data."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # keeps the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def save_model(model, cfg, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    state = {name: p for name, p in model.state_dict().items()}
    write_safetensors(os.path.join(out_dir, "model.safetensors"), state)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    generation = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                  "pad_token_id": cfg["eos_token_id"], "do_sample": True, "temperature": 0.8, "top_k": 40,
                  "max_length": cfg["max_position_embeddings"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
        f.write("\n")


# ---- training -----------------------------------------------------------------------------------------
def make_config(args, vocab_size, bos_id, eos_id):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


@torch.no_grad()
def sample(model, tokenizer, prompt, new_tokens, temperature, generator):
    ids = tokenizer.encode(prompt)
    eos = model.cfg["eos_token_id"]
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids[-model.cfg["max_position_embeddings"]:]]))[0, -1]
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            next_id = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        if next_id == eos:
            break
        ids.append(next_id)
    return tokenizer.decode(ids)


@torch.no_grad()
def evaluate(model, batches):
    model.eval()
    losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def windows(stream, starts, seq_len):
    x = torch.stack([stream[s:s + seq_len] for s in starts])
    y = torch.stack([stream[s + 1:s + seq_len + 1] for s in starts])
    return x, y


def main():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    ap.add_argument("--out", default=os.path.join(repo, "models", "kiln-tiny"))
    ap.add_argument("--vocab", type=int, default=2048, help="256 bytes + merges + 2 special tokens")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=344)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128, help="training window (<= 256)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too (0: no limit)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.time()

    fortunes = read_fortunes(FORTUNE_DIR)
    rng.shuffle(fortunes)
    num_val = max(1, len(fortunes) // 50)
    val_fortunes, train_fortunes = fortunes[:num_val], fortunes[num_val:]
    print(f"corpus: {len(fortunes)} fortunes, {sum(map(len, fortunes))} characters, {num_val} held out", flush=True)

    merges = train_bpe(train_fortunes, args.vocab - 256 - 2)
    os.makedirs(args.out, exist_ok=True)
    tokenizer_path = os.path.join(args.out, "tokenizer.json")
    with open(tokenizer_path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(merges), f, ensure_ascii=False, indent=1)
        f.write("\n")
    tokenizer = ByteLevelBPE(tokenizer_path)
    vocab_size = len(tokenizer.vocab)
    bos_id, eos_id = tokenizer.vocab[BOS], tokenizer.vocab[EOS]
    print(f"tokenizer: {len(merges)} merges, vocab {vocab_size} ({time.time() - started:.0f}s); "
          f"first merges {merges[:8]}", flush=True)

    piece_cache = {}

    def encode(text):  # <|bos|> text <|eos|>; pieces repeat a lot, so cache their BPE.
        ids = [bos_id]
        for piece in pre_tokenize(text):
            if piece not in piece_cache:
                piece_cache[piece] = tokenizer.encode(piece, add_special_tokens=False)
            ids.extend(piece_cache[piece])
        return ids + [eos_id]

    train_stream = torch.tensor([i for t in train_fortunes for i in encode(t)], dtype=torch.int64)
    val_stream = torch.tensor([i for t in val_fortunes for i in encode(t)], dtype=torch.int64)
    print(f"tokens: train {len(train_stream)}, val {len(val_stream)} "
          f"({sum(map(len, train_fortunes)) / len(train_stream):.2f} chars/token)", flush=True)

    cfg = make_config(args, vocab_size, bos_id, eos_id)
    model = LlamaForCausalLM(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params} parameters, config {json.dumps({k: cfg[k] for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads')})}", flush=True)

    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    val_starts = list(range(0, len(val_stream) - args.seq - 1, args.seq))[:64]
    val_batches = [windows(val_stream, val_starts[i:i + args.batch], args.seq) for i in range(0, len(val_starts), args.batch)]

    budget = args.minutes * 60.0
    train_start = time.time()
    step, smoothed, last_save = 0, None, train_start
    while True:
        elapsed = time.time() - train_start
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        # Linear warmup by step, then cosine down to 10% by the wall-clock budget.
        progress = min(1.0, elapsed / budget)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = [rng.randrange(0, len(train_stream) - args.seq - 1) for _ in range(args.batch)]
        x, y = windows(train_stream, starts, args.seq)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % 10 == 0:
            print(f"step {step:5d}  {elapsed:6.0f}s  lr {lr:.2e}  loss {loss.item():.3f}  smoothed {smoothed:.3f}", flush=True)
        if step % 200 == 0:
            print(f"step {step:5d}  val loss {evaluate(model, val_batches):.3f}", flush=True)
        if time.time() - last_save > 300:  # a usable model exists even if the run is cut short
            save_model(model, cfg, args.out)
            last_save = time.time()

    val_loss = evaluate(model, val_batches)
    print(f"done: {step} steps, {step * args.batch * args.seq} tokens seen, {time.time() - train_start:.0f}s; "
          f"train loss (smoothed) {smoothed:.3f}, val loss {val_loss:.3f}", flush=True)
    model.eval()
    save_model(model, cfg, args.out)
    print(f"saved {args.out}", flush=True)

    generator = torch.Generator().manual_seed(args.seed)
    for prompt in ["The meaning of life is", "Once upon a time", "A computer", "Love is", "Q: Why did the chicken"]:
        print(f"greedy   {prompt!r}: {sample(model, tokenizer, prompt, 40, 0.0, generator)!r}", flush=True)
        print(f"temp 0.8 {prompt!r}: {sample(model, tokenizer, prompt, 40, 0.8, generator)!r}", flush=True)


if __name__ == "__main__":
    main()
