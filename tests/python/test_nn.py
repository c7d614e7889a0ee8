"""kiln.nn from Python: Module subclasses traced into graphs (weights registered by attribute, named by
path, state_dict / load_state_dict), the built-in layers against numpy, and a Llama block written in
Python against kiln's C++ TransformerBlock and a plain-PyTorch reference with the same weights."""
import math

import numpy as np
import pytest
import torch

from kiln import nn
from kiln.dtype import DType
from kiln.graph import BufferType, DeviceRef, Dim, Graph, TensorType, Weight, ops
from kiln.pipelines import GraphSpec, compile_graph_specs

CPU = DeviceRef.CPU()


class Affine(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = Weight("weight", DType.float32, [n_in, n_out], CPU)
        self.bias = Weight("bias", DType.float32, [n_out], CPU)

    def __call__(self, x):
        return x @ self.weight + self.bias


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.LayerList([Affine(4, 8), Affine(8, 2)])

    def __call__(self, x):
        return self.layers[1](ops.relu(self.layers[0](x)))


def test_weights_are_named_by_attribute_path_even_when_attached_later():
    m = TwoLayers()
    assert sorted(m.state_dict()) == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    assert all(not t.to_numpy().any() for t in m.state_dict().values())   # zeros until loaded, as MAX's
    raw = m.raw_state_dict()
    assert [int(d) for d in raw["layers.1.weight"].shape] == [8, 2]
    assert m.layers[1].path == "layers.1"


def test_a_python_module_runs_and_matches_numpy(session):
    rng = np.random.default_rng(1)
    weights = {"layers.0.weight": rng.standard_normal((4, 8), dtype=np.float32),
               "layers.0.bias": rng.standard_normal(8, dtype=np.float32),
               "layers.1.weight": rng.standard_normal((8, 2), dtype=np.float32),
               "layers.1.bias": rng.standard_normal(2, dtype=np.float32)}
    m = TwoLayers()
    m.load_state_dict(weights)
    assert m.state_dict()["layers.0.weight"].data_ptr() == weights["layers.0.weight"].ctypes.data  # bound, not copied
    spec = GraphSpec(module=m, name="mlp", input_types=[TensorType(DType.float32, ["batch", 4])])
    model = compile_graph_specs(session, [spec])["mlp"]
    x = rng.standard_normal((3, 4), dtype=np.float32)
    h = np.maximum(x @ weights["layers.0.weight"] + weights["layers.0.bias"], 0)
    np.testing.assert_allclose(np.asarray(model.execute(x)[0]), h @ weights["layers.1.weight"] + weights["layers.1.bias"],
                               rtol=1e-5, atol=1e-5)


def test_a_loaded_weight_outlives_the_array_name_it_came_from(session):
    m = Affine(2, 2)
    weight, bias = np.eye(2, dtype=np.float32) * 3, np.ones(2, np.float32)
    m.load_state_dict({"weight": weight, "bias": bias})
    del weight, bias
    import gc
    gc.collect()
    spec = GraphSpec(module=m, name="affine", input_types=[TensorType(DType.float32, [1, 2])])
    out = compile_graph_specs(session, [spec])["affine"].execute(np.array([[1, 2]], np.float32))[0]
    np.testing.assert_array_equal(np.asarray(out), [[4, 7]])


def test_load_state_dict_checks_names_shapes_and_dtypes():
    m = Affine(2, 3)
    with pytest.raises(ValueError, match="bias") as e:
        m.load_state_dict({"weight": np.zeros((2, 3), np.float32), "extra": np.zeros(1, np.float32)})
    assert "extra" in str(e.value)
    with pytest.raises(ValueError, match="weight"):
        m.load_state_dict({"weight": np.zeros((3, 2), np.float32), "bias": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="weight"):
        m.load_state_dict({"weight": np.zeros((2, 3), np.float64), "bias": np.zeros(3, np.float32)})
    m.load_state_dict({"weight": np.ones((2, 3), np.float32)}, strict=False)
    assert m.state_dict()["weight"].to_numpy().sum() == 6


def test_built_in_layers_match_numpy(session):
    rng = np.random.default_rng(2)

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 3, DType.float32, CPU, has_bias=True)
            self.embed = nn.Embedding(10, 4, DType.float32, CPU)
            self.norm = nn.RMSNorm(4, DType.float32, 1e-5)
            self.ln = nn.LayerNorm(4, DType.float32, 1e-5)

        def __call__(self, ids):
            h = self.embed(ids)
            return self.proj(self.norm(h)), self.ln(h)

    m = Layers()
    w = {"proj.weight": rng.standard_normal((3, 4), dtype=np.float32), "proj.bias": rng.standard_normal(3, dtype=np.float32),
         "embed.weight": rng.standard_normal((10, 4), dtype=np.float32), "norm.weight": rng.standard_normal(4, dtype=np.float32),
         "ln.weight": rng.standard_normal(4, dtype=np.float32), "ln.bias": rng.standard_normal(4, dtype=np.float32)}
    m.load_state_dict(w)
    model = compile_graph_specs(session, [GraphSpec(module=m, name="layers", input_types=[TensorType(DType.int64, ["seq"])])])["layers"]
    ids = np.array([3, 0, 9], np.int64)
    proj, ln = model.execute(ids)
    h = w["embed.weight"][ids]
    normed = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * w["norm.weight"]
    np.testing.assert_allclose(np.asarray(proj), normed @ w["proj.weight"].T + w["proj.bias"], rtol=1e-4, atol=1e-5)
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(ln), (h - mu) / np.sqrt(var + 1e-5) * w["ln.weight"] + w["ln.bias"], rtol=1e-4, atol=1e-5)


# ---- a Llama block: Python, kiln's C++ layers, plain torch --------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, SEQ, EPS, THETA = 16, 4, 2, 4, 32, 5, 1e-5, 10000.0


def rotate_half(x):                              # [seq, heads, head_dim]
    half = HEAD_DIM // 2
    return ops.concat([-x[..., half:], x[..., :half]], axis=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, DType.float32, CPU)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, DType.float32, CPU)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, DType.float32, CPU)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, DType.float32, CPU)

    def __call__(self, x, cos, sin, masked):     # x [seq, hidden]; cos, sin [seq, head_dim]; masked bool [seq, seq]
        seq = x.shape[0]
        cos, sin = cos.reshape([seq, 1, HEAD_DIM]), sin.reshape([seq, 1, HEAD_DIM])
        q = self.q_proj(x).reshape([seq, HEADS, HEAD_DIM])
        k = self.k_proj(x).reshape([seq, KV_HEADS, HEAD_DIM])
        v = self.v_proj(x).reshape([seq, KV_HEADS, HEAD_DIM])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        group = HEADS // KV_HEADS                # each kv head serves `group` query heads
        k = ops.broadcast_to(k.reshape([seq, KV_HEADS, 1, HEAD_DIM]), [seq, KV_HEADS, group, HEAD_DIM]).reshape([seq, HEADS, HEAD_DIM])
        v = ops.broadcast_to(v.reshape([seq, KV_HEADS, 1, HEAD_DIM]), [seq, KV_HEADS, group, HEAD_DIM]).reshape([seq, HEADS, HEAD_DIM])
        scores = ops.permute(q, [1, 0, 2]) @ ops.permute(k, [1, 2, 0]) * (1 / math.sqrt(HEAD_DIM))  # [heads, seq, seq]
        scores = ops.where(masked, ops.constant(-1e30, DType.float32), scores)
        out = ops.softmax(scores) @ ops.permute(v, [1, 0, 2])                                       # [heads, seq, head_dim]
        return self.o_proj(ops.permute(out, [1, 0, 2]).reshape([seq, HEADS * HEAD_DIM]))


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN, DType.float32, EPS)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN, DType.float32, EPS)
        self.mlp = nn.MLP(HIDDEN, FFN, DType.float32, CPU, activation_function="silu")
        self._rope = nn.RotaryEmbedding(HEAD_DIM, THETA, 64)  # no weights: not registered

    def __call__(self, x, positions):
        seq = x.shape[0]
        cos, sin = self._rope.cos_sin(positions)
        masked = positions.reshape([1, seq]) > positions.reshape([seq, 1])   # key after query
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, masked)
        return h + self.mlp(self.post_attention_layernorm(h))


def torch_llama_block(x, w):
    """Hugging Face's LlamaDecoderLayer, written out in plain torch."""
    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * weight

    def rot(t):
        return torch.cat([-t[..., HEAD_DIM // 2:], t[..., :HEAD_DIM // 2]], dim=-1)

    lin = lambda t, name: t @ w[name].T
    seq = x.shape[0]
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().float()[:, None, :], emb.sin().float()[:, None, :]
    h = rms(x, w["input_layernorm.weight"])
    q = lin(h, "self_attn.q_proj.weight").view(seq, HEADS, HEAD_DIM)
    k = lin(h, "self_attn.k_proj.weight").view(seq, KV_HEADS, HEAD_DIM)
    v = lin(h, "self_attn.v_proj.weight").view(seq, KV_HEADS, HEAD_DIM)
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = q.transpose(0, 1) @ k.permute(1, 2, 0) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), float("-inf"))
    attn = (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).reshape(seq, HEADS * HEAD_DIM)
    h1 = x + lin(attn, "self_attn.o_proj.weight")
    m = rms(h1, w["post_attention_layernorm.weight"])
    mlp = lin(torch.nn.functional.silu(lin(m, "mlp.gate_proj.weight")) * lin(m, "mlp.up_proj.weight"), "mlp.down_proj.weight")
    return h1 + mlp


def test_a_python_llama_block_matches_the_cpp_block_and_torch(session):
    block = LlamaBlock()
    torch.manual_seed(0)
    weights = {name: (torch.rand(*[int(d) for d in decl.shape]) - 0.5) * 0.5 for name, decl in block.raw_state_dict().items()}
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        weights[name] = 1 + 0.1 * torch.randn(HIDDEN)
    block.load_state_dict(weights)            # torch tensors, bound without copies
    x = torch.randn(SEQ, HIDDEN)
    expected = torch_llama_block(x, weights).numpy()

    spec = GraphSpec(module=block, name="block",
                     input_types=[TensorType(DType.float32, [SEQ, HIDDEN]), TensorType(DType.int64, [SEQ])])
    ours = np.asarray(compile_graph_specs(session, [spec])["block"].execute(x, torch.arange(SEQ))[0])
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)

    # kiln's own C++ TransformerBlock (KV-cache convention, docs/llama.md) on the same weights.
    config = nn.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, rms_norm_eps=EPS, rope_theta=THETA, num_hidden_layers=1)
    cpp_block = nn.TransformerBlock(config, 0)
    assert sorted(cpp_block.state_dict()) == sorted(weights)   # the same names, so checkpoints load unchanged
    cpp_block.load_state_dict(weights)
    rope = nn.RotaryEmbedding(HEAD_DIM, THETA, 64)
    cache = BufferType(DType.float32, [1, 8, KV_HEADS, HEAD_DIM])
    with Graph("cpp_block", input_types=[TensorType(DType.float32, [SEQ, HIDDEN]), TensorType(DType.int64, [SEQ]), cache, cache]) as g:
        h, mask, k, v = g.inputs
        ctx = nn.make_attention_context(nn.KVCache(k, v), mask, Dim(SEQ), rope)
        g.output(cpp_block(h, ctx))
    k_cache, v_cache = np.zeros((1, 8, KV_HEADS, HEAD_DIM), np.float32), np.zeros((1, 8, KV_HEADS, HEAD_DIM), np.float32)
    theirs = np.asarray(session.load(g, weights_registry=cpp_block.state_dict()).execute(
        x, np.ones(SEQ, np.int64), k_cache, v_cache)[0])
    np.testing.assert_allclose(theirs, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert np.abs(k_cache[0, :SEQ]).sum() > 0 and not k_cache[0, SEQ:].any()   # the block wrote its keys in place
