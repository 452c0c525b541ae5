"""Gemma 4: Gemma 3's block (scaled embedding, norms before and after attention and FFN,
QK-norm, GELU-tanh gated FFN) with

- sliding-window layers chosen per layer by ``attention.sliding_window_pattern`` (a bool
  array), with their own head size (``attention.key_length_swa``), rotated dims and rope
  base (``rope.freq_base_swa``); full layers rotate with the ``rope_freqs`` divisors (its
  proportional RoPE);
- values RMS-normed without a weight, no query scaling (attention scale 1: QK-norm sets it),
  and full layers whose file has no ``attn_v`` use their keys as values;
- KV shared across layers: the last ``attention.shared_kv_layers`` layers have no keys or
  values of their own and attend over those of the last earlier layer of their kind (the
  last full layer, or the sliding one before it), as llama.cpp's Gemma 3n/4 reuse rule.
  They are in that layer's KV group and read its pages (BlockSpec.kv_source): no pages of
  their own;
- per-layer token embeddings (``embedding_length_per_layer_input`` > 0): a second embedding
  of width layers x P, plus a projection of the scaled token embedding (RMS-normed per layer),
  give each layer a P-wide input that gates a GELU bottleneck added after its FFN;
- an optional scalar per layer (``layer_output_scale``) and the final logit softcap;
- optional MoE layers: the dense FFN (``ffn_norm`` .. ``post_ffw_norm_1``) plus top-k GELU
  experts (``pre_ffw_norm_2`` .. ``post_ffw_norm_2``), summed before ``post_ffw_norm``. The
  router reads the weightless RMS norm of the residual over sqrt(dim), times
  ``ffn_gate_inp.scale``: the same normalized row as the experts' input but for the
  elementwise weights, which are folded into the router's columns (scale / sqrt(dim) /
  pre_ffw_norm_2). Gate and up experts come as two stacks or fused (``ffn_gate_up_exps``,
  as the converter writes them), with a scale per expert on its output
  (``ffn_down_exps.scale``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from localllm.backends.base import RopeSpec
from localllm.kernels.kvpages import key_balance

from localllm.backends.base import MoESpec, MoEWeights
from localllm.formats.dequant import dequantize

from . import llama
from .block import BlockSpec
from .common import ModelError, WeightLoader, meta_float, meta_get, meta_int
from .moe import down_scale, expert_home, gate_up
from .net import Net, PlacedLayer


def _layer_ints(meta: dict, key: str, n: int, default: int | None = None) -> tuple[int, ...]:
    """A per-layer integer key (an array of n, or one value for all)."""
    v = meta_get(meta, key, default, required=default is None)
    if hasattr(v, "__len__") and not isinstance(v, str):
        vals = tuple(int(a) for a in v)
        if len(vals) != n:
            raise ModelError(f"metadata {key!r} has {len(vals)} values for {n} layers")
        return vals
    return (meta_int(meta, key, default),) * n


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    swa_layers: tuple = ()          # per layer: sliding window attention
    sliding_window: int = 0
    swa_head_dim: int = 0
    swa_rot: int = 0
    swa_theta: float = 10000.0
    shared_kv: int = 0              # the last layers, which read an earlier layer's KV
    per_layer_dim: int = 0          # per-layer token embedding width (0: none)
    softcap: float = 0.0            # final logit softcapping (0: none)
    layer_kv_heads: tuple = ()
    layer_hidden: tuple = ()

    rope_scalings = ("none", "linear")

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "gemma4") -> "ModelArgs":
        p = f"{arch}."
        n_layers = meta_int(meta, p + "block_count")
        kv_heads = _layer_ints(meta, p + "attention.head_count_kv",
                               n_layers, meta_int(meta, p + "attention.head_count"))
        hidden = _layer_ints(meta, p + "feed_forward_length", n_layers)
        # the llama reader takes scalars: the largest (what the KV planner sizes for)
        flat = {**meta, p + "attention.head_count_kv": max(kv_heads),
                p + "feed_forward_length": max(hidden)}
        base = llama.ModelArgs.from_gguf(flat, arch)
        pattern = meta_get(meta, p + "attention.sliding_window_pattern", required=True)
        if not hasattr(pattern, "__len__") or len(pattern) != n_layers:
            raise ModelError(f"metadata '{p}attention.sliding_window_pattern' must be one "
                             f"flag per layer ({n_layers})")
        swa_hd = meta_int(meta, p + "attention.key_length_swa", base.head_dim)
        if meta_int(meta, p + "attention.value_length_swa", swa_hd) != swa_hd:
            raise ModelError(f"metadata '{p}attention.value_length_swa' differs from the key "
                             f"length ({swa_hd}); not supported")
        args = cls(**{**base.__dict__,
                      "swa_layers": tuple(bool(x) for x in pattern),
                      "sliding_window": meta_int(meta, p + "attention.sliding_window"),
                      "swa_head_dim": swa_hd,
                      "swa_rot": meta_int(meta, p + "rope.dimension_count_swa", base.n_rot),
                      "swa_theta": meta_float(meta, p + "rope.freq_base_swa", 10000.0),
                      "shared_kv": meta_int(meta, p + "attention.shared_kv_layers", 0),
                      "per_layer_dim": meta_int(meta, p + "embedding_length_per_layer_input", 0),
                      "softcap": meta_float(meta, p + "final_logit_softcapping", 0.0),
                      "layer_kv_heads": kv_heads, "layer_hidden": hidden})
        args.check()
        return args

    def check(self) -> None:
        super().check()
        p = f"'{self.arch}."
        if any(self.swa_layers) and self.sliding_window <= 0:
            raise ModelError(f"metadata {p}attention.sliding_window' must be positive")
        if not 0 <= self.swa_rot <= self.swa_head_dim or self.swa_rot % 2:
            raise ModelError(f"metadata {p}rope.dimension_count_swa' ({self.swa_rot}) must be "
                             f"even and at most the sliding head size {self.swa_head_dim}")
        if self.shared_kv:
            first = self.n_layers - self.shared_kv
            if not 2 <= first < self.n_layers:
                raise ModelError(f"metadata {p}attention.shared_kv_layers' "
                                 f"({self.shared_kv}) must leave at least two of the "
                                 f"{self.n_layers} layers with their own KV")
            for i in range(first, self.n_layers):
                src = self.kv_source(i)
                if self.swa_layers[src] != self.swa_layers[i]:
                    raise ModelError(f"layer {i} shares the KV of layer {src}, which is "
                                     f"{'' if self.swa_layers[src] else 'not '}sliding: the "
                                     f"sliding_window_pattern does not fit shared_kv_layers")
        if self.softcap < 0:
            raise ModelError(f"metadata {p}final_logit_softcapping' must not be negative")

    def kv_source(self, i: int) -> int:
        """The layer whose KV layer i reads: itself, or for a shared layer the last layer
        with KV before the shared ones (full) or the one before that (sliding)."""
        first = self.n_layers - self.shared_kv
        if i < first:
            return i
        return first - (2 if self.swa_layers[i] else 1)

    def layer_head_dim(self, i: int) -> int:
        return self.swa_head_dim if self.swa_layers[i] else self.head_dim

    def kv_layers(self) -> list:
        first = self.n_layers - self.shared_kv
        return [(self.layer_kv_heads[i], self.layer_head_dim(i)) if i < first else None
                for i in range(self.n_layers)]


@dataclass(frozen=True)
class Gemma4Weights:
    """One layer's tensors; wk/wv/k_norm None on shared-KV layers, wv None where the keys
    are the values, the per-layer embedding parts None without them."""
    attn_norm: object
    wq: object
    wk: object
    wv: object
    wo: object
    q_norm: object
    k_norm: object
    v_norm: object           # ones: the values' weightless RMSNorm
    post_attn_norm: object
    ffn_norm: object
    w_gate: object
    w_up: object
    w_down: object
    post_ffn_norm: object
    pl_gate: object = None   # per-layer input gate (P, dim), projection (dim, P), post-norm
    pl_proj: object = None
    pl_norm: object = None
    out_scale: float = 1.0
    moe: MoEWeights | None = None   # the experts, with their norms before and after and
    pre_moe_norm: object = None     # the dense FFN's own post-norm
    post_moe_norm: object = None
    post_dense_norm: object = None


class Model(Net):
    activation = "gelu_tanh"

    def __init__(self, args: ModelArgs, w: WeightLoader, ctx: int = 0):
        self.args = a = args
        self.be = w.placement.embed
        self.head_be = w.placement.head
        freq = None
        if w.has("rope_freqs.weight"):
            freq = w.host_vector("rope_freqs.weight", a.n_rot // 2)
        self.rope = RopeSpec(a.n_rot, a.rope_theta, True, a.rope_scale, freq, a.rope_attn_factor)
        self.rope_local = RopeSpec(a.swa_rot, a.swa_theta, True, 1.0, None, a.rope_attn_factor)
        self.embed_scale = math.sqrt(a.dim)
        self.tok_embd = w.embedding("token_embd.weight", a.vocab_size, a.dim)
        P, L = a.per_layer_dim, a.n_layers
        if P:
            self.pl_embd = w.embedding("per_layer_token_embd.weight", a.vocab_size, L * P)
            self.pl_model_proj = w.matrix("per_layer_model_proj.weight", L * P, a.dim)
            # Rows scaled by 1/sqrt(2) (the sum of the two per-layer inputs is) and the
            # projection's 1/sqrt(dim) folded into the norm's epsilon.
            self.pl_proj_norm = self.be.upload_vector(
                w.host_vector("per_layer_proj_norm.weight", P) * np.float32(1 / math.sqrt(2)))
        self.layers = []
        balances = {}
        for i in range(L):
            weights = self.load_block(w, i)
            spec = self.block_spec(i)
            src = a.kv_source(i)
            if src == i:
                spec = replace(spec, k_balance=self._balance(w, i))
                balances[i] = spec.k_balance
            else:  # the queries are balanced as the keys they meet were stored
                spec = replace(spec, k_balance=balances[src], kv_source=src)
            if weights.moe is not None:  # softmax top-k, renormalised, GELU experts
                spec = replace(spec, moe=MoESpec(a.n_experts, a.n_experts_used, "softmax",
                                                 True, 0.0, self.activation))
            self.layers.append(PlacedLayer(i, w.placement.layers[i], weights, spec))
        self.out_norm = w.vector("output_norm.weight", a.dim)
        name = "output.weight" if w.has("output.weight") else "token_embd.weight"
        self.output = w.matrix(name, a.vocab_size, a.dim, head=True)

    def _balance(self, w: WeightLoader, i: int):
        hd = self.args.layer_head_dim(i)
        spec = self.block_spec(i)
        return key_balance(w.host_vector(f"blk.{i}.attn_q_norm.weight", hd),
                           w.host_vector(f"blk.{i}.attn_k_norm.weight", hd),
                           spec.rope.n_rot, True)

    def block_spec(self, i: int) -> BlockSpec:
        a = self.args
        sliding = a.swa_layers[i]
        return BlockSpec(a.n_heads, a.layer_kv_heads[i], a.layer_head_dim(i), a.norm_eps,
                         self.rope_local if sliding else self.rope, 1.0,
                         a.sliding_window if sliding else 0, self.activation)

    def load_block(self, w: WeightLoader, i: int) -> Gemma4Weights:
        a, p = self.args, f"blk.{i}."
        if w.has(p + "attn_qkv.weight"):
            raise ModelError(f"layer {i}: a fused attn_qkv is not supported for gemma4")
        hd, n_kv, F = a.layer_head_dim(i), a.layer_kv_heads[i], a.layer_hidden[i]
        qd, kvd = a.n_heads * hd, n_kv * hd
        own = a.kv_source(i) == i
        wk = w.matrix(p + "attn_k.weight", kvd, a.dim) if own else None
        wv = w.matrix(p + "attn_v.weight", kvd, a.dim) if own and w.has(
            p + "attn_v.weight") else None
        be = w.backend_for(p + "attn_q.weight")
        P = a.per_layer_dim
        moe = self.load_experts(w, i) if w.has(p + "ffn_gate_inp.weight") else {}
        scale = 1.0
        if w.has(p + "layer_output_scale.weight"):
            scale = float(w.host_vector(p + "layer_output_scale.weight", 1)[0])
        return Gemma4Weights(
            attn_norm=w.vector(p + "attn_norm.weight", a.dim),
            wq=w.matrix(p + "attn_q.weight", qd, a.dim), wk=wk, wv=wv,
            wo=w.matrix(p + "attn_output.weight", a.dim, qd),
            q_norm=w.vector(p + "attn_q_norm.weight", hd),
            k_norm=w.vector(p + "attn_k_norm.weight", hd) if own else None,
            v_norm=be.upload_vector(np.ones(hd, np.float32)),
            post_attn_norm=w.vector(p + "post_attention_norm.weight", a.dim),
            ffn_norm=w.vector(p + "ffn_norm.weight", a.dim),
            w_gate=w.matrix(p + "ffn_gate.weight", F, a.dim),
            w_up=w.matrix(p + "ffn_up.weight", F, a.dim),
            w_down=w.matrix(p + "ffn_down.weight", a.dim, F),
            post_ffn_norm=w.vector(p + "post_ffw_norm.weight", a.dim),
            pl_gate=w.matrix(p + "inp_gate.weight", P, a.dim) if P else None,
            pl_proj=w.matrix(p + "proj.weight", a.dim, P) if P else None,
            pl_norm=w.vector(p + "post_norm.weight", a.dim) if P else None,
            out_scale=scale, **moe)

    def load_experts(self, w: WeightLoader, i: int) -> dict:
        """Layer i's experts, their norms and the router with its input weights folded in
        (Gemma4Weights fields)."""
        a, p = self.args, f"blk.{i}."
        if a.n_experts == 0:
            raise ModelError(f"layer {i} has experts but metadata '{a.arch}.expert_count' is "
                             "missing")
        E, F, D = a.n_experts, a.expert_hidden_dim, a.dim
        pre = w.host_vector(p + "pre_ffw_norm_2.weight", D)
        if not np.all(pre != 0):
            raise ModelError(f"layer {i}: pre_ffw_norm_2 has zero weights; its router input "
                             "cannot be taken from the experts' input")
        info = w.file.tensors.get(p + "ffn_gate_inp.weight")
        if info is None or tuple(info.shape) != (E, D):
            raise ModelError(f"tensor '{p}ffn_gate_inp.weight' should have shape {(E, D)}")
        router = dequantize(w.file.raw(p + "ffn_gate_inp.weight"), info.type_name, (E, D))
        fold = (w.host_vector(p + "ffn_gate_inp.scale", D).astype(np.float64)
                / math.sqrt(D) / pre.astype(np.float64))
        router = np.ascontiguousarray((router.astype(np.float64) * fold).astype(np.float32))
        be = expert_home(w, p, i)
        home = w.backend_for(p + "attn_norm.weight")
        gate, up = gate_up(w, p, E, F, D)
        return {"moe": MoEWeights(
                    router=be.upload_matrix(p + "ffn_gate_inp.weight#folded", "F32",
                                            router.view(np.uint8).reshape(-1), E, D),
                    gate=gate, up=up, down=w.experts(p + "ffn_down_exps.weight", E, D, F),
                    backend=None if be is home else be, down_scale=down_scale(w, p, E)),
                "pre_moe_norm": home.upload_vector(pre),
                "post_moe_norm": w.vector(p + "post_ffw_norm_2.weight", D),
                "post_dense_norm": w.vector(p + "post_ffw_norm_1.weight", D)}

    def embed(self, ids):
        return self.be.embed(self.tok_embd, ids, self.embed_scale)

    def per_layer_inputs(self, ids, x0):
        """Each layer's (n, P) input as float32 numpy (n, layers, P): the per-layer token
        embedding (times sqrt(P)) plus the RMS-normed projection of the scaled token
        embedding (times 1/sqrt(dim)), over sqrt(2)."""
        a, be = self.args, self.be
        P, L = a.per_layer_dim, a.n_layers
        tok = be.to_numpy(be.embed(self.pl_embd, ids, math.sqrt(P) / math.sqrt(2)))
        proj = be.linear(x0, [self.pl_model_proj])[0]
        # rms_norm(x / sqrt(dim), eps) == rms_norm(x, eps * dim)
        proj = be.to_numpy(be.head_norm(proj, L, self.pl_proj_norm, a.norm_eps * a.dim))
        return (np.asarray(proj, np.float32) + np.asarray(tok, np.float32)).reshape(-1, L, P)

    def block(self, be, x, w: Gemma4Weights, s: BlockSpec, positions, kv, shared: dict,
              index: int, pl_input):
        """One layer (composed from backend operations); ``shared`` keeps the keys and
        values of the layers that others read (by layer index, with their backend)."""
        h = be.rms_norm(x, w.attn_norm, s.norm_eps)
        if s.kv_source < 0:
            wv = w.wv if w.wv is not None else w.wk  # no attn_v: the values are the keys
            q, k, v = be.linear(h, [w.wq, w.wk, wv])
            q = be.head_norm(q, s.n_heads, w.q_norm, s.norm_eps)
            k = be.head_norm(k, s.n_kv_heads, w.k_norm, s.norm_eps)
            v = be.head_norm(v, s.n_kv_heads, w.v_norm, s.norm_eps)
            q = be.rope(q, s.n_heads, positions, s.rope)
            k = be.rope(k, s.n_kv_heads, positions, s.rope)
            o = be.attention(q, k, v, kv, positions, s.n_heads, s.attn_scale, s.window,
                             s.k_balance)
            shared[index] = (be, k, v)
        else:
            q = be.linear(h, [w.wq])[0]
            q = be.head_norm(q, s.n_heads, w.q_norm, s.norm_eps)
            q = be.rope(q, s.n_heads, positions, s.rope)
            # The source layer's pages (this layer's KVBatch is theirs): storing its keys
            # and values again at the same slots leaves them as they are.
            sb, k, v = shared[s.kv_source]
            if sb is not be:
                q = sb.from_numpy(be.to_numpy(q))
            o = sb.attention(q, k, v, kv, positions, s.n_heads, s.attn_scale, s.window,
                             s.k_balance)
            if sb is not be:
                o = be.from_numpy(sb.to_numpy(o))
        o = be.linear(o, [w.wo])[0]
        o = be.rms_norm(o, w.post_attn_norm, s.norm_eps)
        x = be.add(x, o)
        h = be.rms_norm(x, w.ffn_norm, s.norm_eps)
        gate, up = be.linear(h, [w.w_gate, w.w_up])
        y = be.linear(be.glu(gate, up, s.activation), [w.w_down])[0]
        if w.moe is not None:
            y = be.rms_norm(y, w.post_dense_norm, s.norm_eps)
            h = be.rms_norm(x, w.pre_moe_norm, s.norm_eps)
            home = w.moe.backend
            if home is not None:  # the experts live elsewhere (e.g. on the CPU)
                e = be.from_numpy(home.to_numpy(home.moe_ffn(home.from_numpy(
                    be.to_numpy(h)), w.moe, s.moe)))
            else:
                e = be.moe_ffn(h, w.moe, s.moe)
            y = be.add(y, be.rms_norm(e, w.post_moe_norm, s.norm_eps))
        y = be.rms_norm(y, w.post_ffn_norm, s.norm_eps)
        x = be.add(x, y)
        if pl_input is not None:
            g = be.linear(x, [w.pl_gate])[0]
            g = be.glu(g, be.from_numpy(np.ascontiguousarray(pl_input)), "gelu_tanh")
            y = be.rms_norm(be.linear(g, [w.pl_proj])[0], w.pl_norm, s.norm_eps)
            x = be.add(x, y)
        if w.out_scale != 1.0:
            x = be.from_numpy(np.asarray(be.to_numpy(x), np.float32) * np.float32(w.out_scale))
        return x

    def forward(self, ids, positions, kv, logit_rows, hidden: bool = False):
        x = self.embed(ids)
        be = self.be
        pl = self.per_layer_inputs(ids, x) if self.args.per_layer_dim else None
        shared: dict = {}
        for layer in self.layers:
            if layer.backend is not be:
                x = layer.backend.from_numpy(be.to_numpy(x))
                be = layer.backend
            x = self.block(be, x, layer.weights, layer.spec, positions, kv.layer(layer.index),
                           shared, layer.index, None if pl is None else pl[:, layer.index])
        if len(logit_rows) == 0:
            return None
        if self.head_be is not be:
            x = self.head_be.from_numpy(be.to_numpy(x))
        hb = self.head_be
        x = hb.select_rows(x, logit_rows)
        x = hb.rms_norm(x, self.out_norm, self.args.norm_eps)
        if hidden:
            return hb.to_numpy(x)
        logits = np.asarray(hb.to_numpy(hb.linear(x, [self.output])[0]), np.float32)
        if self.args.softcap:
            c = np.float32(self.args.softcap)
            logits = np.tanh(logits * np.float32(1 / c)) * c
        return logits
