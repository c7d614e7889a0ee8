"""GPT-2 style byte-level BPE, as Hugging Face tokenizers runs a tokenizer.json with a ByteLevel
pre-tokenizer (add_prefix_space false, use_regex true), a BPE model and a ByteLevel decoder.

Shared by tools/train_tiny_model.py (which learns the merges) and tools/reference/generate_reference.py
(which encodes prompts from the committed tokenizer.json). Plain Python, no tokenizers library.
"""
import json
import unicodedata

# GPT-2's pre-tokenizer regex, which Hugging Face's ByteLevel pre-tokenizer applies when use_regex is true:
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# Python's `re` has no \p{L}, so pre_tokenize() below is a hand-written matcher of exactly this
# alternation, with \p{L} and \p{N} taken from unicodedata's general category (L*, N*) and \s from
# str.isspace() minus U+001C..U+001F (which Python counts as space but Unicode White_Space does not).
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")


def bytes_to_unicode():
    """GPT-2's table: every byte maps to a printable character, so a token is a plain string."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _is_space(c):
    return c.isspace() and not ("\x1c" <= c <= "\x1f")


def _char_class(c):
    """'s' whitespace, 'L' letter, 'N' number, 'P' anything else (the regex's [^\\s\\p{L}\\p{N}])."""
    if _is_space(c):
        return "s"
    cat = unicodedata.category(c)
    if cat[0] == "L":
        return "L"
    if cat[0] == "N":
        return "N"
    return "P"


def pre_tokenize(text):
    """Splits text the way the GPT-2 regex above does (leftmost alternative that matches wins)."""
    pieces = []
    i, n = 0, len(text)
    while i < n:
        if text[i] == "'":
            contraction = next((c for c in CONTRACTIONS if text.startswith(c, i)), None)
            if contraction:
                pieces.append(contraction)
                i += len(contraction)
                continue
        # ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional single space, then a run of one class.
        start = i + 1 if text[i] == " " and i + 1 < n else i
        cls = _char_class(text[start])
        if cls != "s":
            end = start
            while end < n and _char_class(text[end]) == cls:
                end += 1
            pieces.append(text[i:end])
            i = end
            continue
        # '\s+(?!\S)' leaves the last space of a run before a non-space to the next piece; a lone
        # whitespace character before a non-space falls through to '\s+'.
        end = i
        while end < n and _is_space(text[end]):
            end += 1
        if end < n and end - i > 1:
            end -= 1
        pieces.append(text[i:end])
        i = end
    return pieces


class ByteLevelBPE:
    """Encoder/decoder for a tokenizer.json written by train_tiny_model.py (or any GPT-2 style file)."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        pre = doc["pre_tokenizer"]
        if pre["type"] != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
            raise ValueError(f"{path}: expected a ByteLevel pre-tokenizer without prefix space, got {pre}")
        model = doc["model"]
        if model["type"] != "BPE":
            raise ValueError(f"{path}: expected a BPE model, got {model['type']}")
        self.vocab = dict(model["vocab"])
        self.special_ids = set()
        for added in doc.get("added_tokens", []):
            self.vocab[added["content"]] = added["id"]
            if added.get("special"):
                self.special_ids.add(added["id"])
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        self.merge_rank = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.prefix_ids = self._template_prefix(doc.get("post_processor"))

    def _template_prefix(self, post):
        """Ids that a TemplateProcessing post-processor puts before the sequence ("<|bos|>" here)."""
        if post is None:
            return []
        if post["type"] != "TemplateProcessing":
            raise ValueError(f"unsupported post_processor {post['type']}")
        ids = []
        for item in post["single"]:
            if "Sequence" in item:
                break
            ids.extend(post["special_tokens"][item["SpecialToken"]["id"]]["ids"])
        return ids

    def _bpe(self, word):
        """Applies merges lowest rank first until none applies (Hugging Face's BPE::merge_word)."""
        symbols = list(word)
        while len(symbols) > 1:
            best = min(range(len(symbols) - 1),
                       key=lambda k: self.merge_rank.get((symbols[k], symbols[k + 1]), float("inf")))
            pair = (symbols[best], symbols[best + 1])
            if pair not in self.merge_rank:
                break
            merged = []
            k = 0
            while k < len(symbols):
                if k < len(symbols) - 1 and (symbols[k], symbols[k + 1]) == pair:
                    merged.append(symbols[k] + symbols[k + 1])
                    k += 2
                else:
                    merged.append(symbols[k])
                    k += 1
            symbols = merged
        return symbols

    def encode(self, text, add_special_tokens=True):
        ids = list(self.prefix_ids) if add_special_tokens else []
        for piece in pre_tokenize(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.vocab[s] for s in self._bpe(mapped))
        return ids

    def decode(self, ids, skip_special_tokens=True):
        data = bytearray()
        for i in ids:
            if i in self.special_ids:
                if not skip_special_tokens:
                    data.extend(self.id_to_token[i].encode("utf-8"))
                continue
            data.extend(self.byte_decoder[c] for c in self.id_to_token[i])
        return data.decode("utf-8", errors="replace")
