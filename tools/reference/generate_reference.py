#!/usr/bin/python3
"""Greedy generations of models/kiln-tiny for kiln's end-to-end test (tests/data/kiln_tiny_greedy.json).

Reads only the committed files: model.safetensors (parsed here by hand), config.json and tokenizer.json
(encoded by tools/reference/byte_level_bpe.py, a plain-Python byte-level BPE). The forward pass is
llama_reference.forward, Hugging Face's LlamaForCausalLM re-implemented in plain torch; nothing comes
from the training script. Generation recomputes the whole sequence each step (no KV cache) and takes the
argmax, as transformers' generate(do_sample=False) does.

Usage: /usr/bin/python3 tools/reference/generate_reference.py [model_dir] [output_json]
"""
import json
import os
import re
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from byte_level_bpe import ByteLevelBPE  # noqa: E402
from llama_reference import forward  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Plain words, a contraction, punctuation and digits, so the test also covers the pre-tokenizer. Picked
# among candidates for a clear greedy margin (min_top2_logit_gap >= 0.01) at every step; pick again
# whenever the model is retrained, since near-ties can flip under f32 rounding differences.
PROMPTS = ["Q: How many programmers does it take to", "The secret of 2 happy people is", "I'd rather be",
           "You will"]
MAX_NEW_TOKENS = 32


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, expected F32")
        begin, end = info["data_offsets"]
        raw = bytearray(data[8 + header_len + begin:8 + header_len + end])
        tensors[name] = torch.frombuffer(raw, dtype=torch.float32).reshape(info["shape"])
    return tensors


def main():
    model_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "models", "kiln-tiny")
    out_path = sys.argv[2] if len(sys.argv) > 2 else os.path.join(REPO, "tests", "data", "kiln_tiny_greedy.json")
    torch.set_num_threads(1)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.setdefault("rope_scaling", None)
    if cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise ValueError("llama_reference.forward assumes head_dim * num_attention_heads == hidden_size")
    weights = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    tokenizer = ByteLevelBPE(os.path.join(model_dir, "tokenizer.json"))
    eos = cfg["eos_token_id"]

    cases = []
    with torch.no_grad():
        for prompt in PROMPTS:
            prompt_ids = tokenizer.encode(prompt)
            ids = list(prompt_ids)
            generated = []
            min_margin = float("inf")
            for _ in range(MAX_NEW_TOKENS):
                logits = forward(cfg, weights, ids)[-1]
                top2 = logits.topk(2).values
                min_margin = min(min_margin, float(top2[0] - top2[1]))
                next_id = int(logits.argmax())
                generated.append(next_id)
                ids.append(next_id)
                if next_id == eos:
                    break
            text = tokenizer.decode(ids)
            print(f"{prompt!r} -> {text!r} (smallest top-1 - top-2 logit gap {min_margin:.4f})")
            cases.append({"prompt": prompt, "prompt_ids": prompt_ids, "generated_ids": generated, "text": text,
                          "min_top2_logit_gap": round(min_margin, 6)})

    doc = {
        "model": "models/kiln-tiny",
        "generator": "tools/reference/generate_reference.py (Hugging Face LlamaForCausalLM in plain torch "
                     + torch.__version__ + ")",
        "decoding": f"greedy (argmax), at most {MAX_NEW_TOKENS} new tokens, f32; generated_ids ends with "
                    "eos_token_id when the model emitted it (it is kept, as transformers' generate() keeps it)",
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": eos,
        "min_top2_logit_gap": "per case, the smallest gap between the best and second-best logit over its "
                              "steps: how far f32 rounding differences are from flipping a greedy choice",
        "max_new_tokens": MAX_NEW_TOKENS,
        "cases": cases,
    }
    text = json.dumps(doc, indent=1)
    # One line per id list keeps the file readable.
    text = re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    with open(out_path, "w") as f:
        f.write(text + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
