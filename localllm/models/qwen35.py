"""Qwen3.5 (dense, and qwen35moe): a hybrid of Gated DeltaNet (linear attention) layers and, every
``full_attention_interval``-th layer, gated full attention, as llama.cpp 0.3.36 builds it.

A DeltaNet layer projects the normed input to mixed q/k/v channels, an output gate z, write
strengths beta and decays alpha; the backend's ``delta_net`` runs the causal conv and the
gated delta rule over the sequence's recurrent state; the output is RMS-normed per head,
times silu(z), projected back. A full-attention layer's query projection holds a query and
a gate per head (interleaved); QK-norm, NeoX RoPE over the first n_rot dims (the multimodal
rope sections reduce to that for text: every rotated pair takes the token's position, pairs
of a fourth section position 0), attention, times sigmoid(gate). Both layer kinds add their
output to the residual, then a SwiGLU FFN on ``post_attention_norm`` (qwen35moe: top-k
softmax experts, renormalised, and a shared expert times its sigmoid gate). Multi-token-prediction
blocks (``nextn_predict_layers``, the last blocks of the file) are not run, as in llama.cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from localllm.backends.base import DeltaNetSpec, DeltaNetWeights, KVBatch, RopeSpec

from . import llama, moe
from .block import BlockSpec
from .common import ModelError, WeightLoader, meta_get, meta_int
from .net import Net, PlacedLayer


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    conv_kernel: int = 4           # {arch}.ssm.conv_kernel
    ssm_inner: int = 0             # {arch}.ssm.inner_size: value heads times head size
    ssm_state: int = 0             # {arch}.ssm.state_size: the key (and value) head size
    n_v_heads: int = 0             # {arch}.ssm.time_step_rank
    n_k_heads: int = 0             # {arch}.ssm.group_count
    recurrent: tuple = ()          # per trunk layer: a DeltaNet layer (else full attention)
    rope_sections: tuple = ()      # {arch}.rope.dimension_sections
    n_nextn: int = 0               # trailing multi-token-prediction blocks (not run)

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "qwen35") -> "ModelArgs":
        base = llama.ModelArgs.from_gguf(meta, arch)
        p = f"{arch}."
        n_all = base.n_layers
        nextn = meta_int(meta, p + "nextn_predict_layers", 0)
        if not 0 <= nextn < n_all:
            raise ModelError(f"metadata '{p}nextn_predict_layers' ({nextn}) must be below "
                             f"'{p}block_count' ({n_all})")
        n = n_all - nextn
        flags = meta_get(meta, p + "attention.recurrent_layers")
        if flags is not None:
            recurrent = tuple(bool(f) for f in list(flags)[:n])
            if len(recurrent) != n:
                raise ModelError(f"metadata '{p}attention.recurrent_layers' has "
                                 f"{len(list(flags))} entries for {n} layers")
        else:
            every = meta_int(meta, p + "full_attention_interval", 4)
            if every <= 0:
                raise ModelError(f"metadata '{p}full_attention_interval' must be positive, "
                                 f"got {every}")
            recurrent = tuple((i + 1) % every != 0 for i in range(n))
        sections = meta_get(meta, p + "rope.dimension_sections", [0, 0, 0, 0])
        args = cls(**{f.name: getattr(base, f.name) for f in fields(llama.ModelArgs)},
                   conv_kernel=meta_int(meta, p + "ssm.conv_kernel"),
                   ssm_inner=meta_int(meta, p + "ssm.inner_size"),
                   ssm_state=meta_int(meta, p + "ssm.state_size"),
                   n_v_heads=meta_int(meta, p + "ssm.time_step_rank"),
                   n_k_heads=meta_int(meta, p + "ssm.group_count"),
                   recurrent=recurrent, rope_sections=tuple(int(x) for x in list(sections)[:4]),
                   n_nextn=nextn)
        args.check_recurrent()
        return args

    def check_recurrent(self) -> None:
        """Raises ModelError, naming the key, for DeltaNet shapes we cannot run."""
        p = f"{self.arch}.ssm."
        for name, key in (("conv_kernel", "conv_kernel"), ("ssm_inner", "inner_size"),
                          ("ssm_state", "state_size"), ("n_v_heads", "time_step_rank"),
                          ("n_k_heads", "group_count")):
            if not getattr(self, name) > 0:
                raise ModelError(f"metadata '{p}{key}' must be positive, "
                                 f"got {getattr(self, name)}")
        if self.n_v_heads % self.n_k_heads:
            raise ModelError(f"metadata '{p}time_step_rank' ({self.n_v_heads}) is not a "
                             f"multiple of '{p}group_count' ({self.n_k_heads})")
        if self.ssm_inner != self.n_v_heads * self.ssm_state:
            raise ModelError(f"metadata '{p}inner_size' ({self.ssm_inner}) is not "
                             f"'{p}time_step_rank' times '{p}state_size' "
                             f"({self.n_v_heads} x {self.ssm_state}): key and value heads "
                             "of different sizes are not supported")
        if self.ssm_state % 16:
            raise ModelError(f"metadata '{p}state_size' ({self.ssm_state}) is not a multiple "
                             "of 16: not supported")
        if all(self.recurrent):
            raise ModelError(f"the file's {len(self.recurrent)} layers are all recurrent "
                             "(no full-attention layer); not supported")

    def kv_layers(self) -> list:
        """Full-attention trunk layers hold KV; DeltaNet layers a state, MTP blocks nothing."""
        trunk = len(self.recurrent)
        return [(self.n_kv_heads, self.head_dim) if i < trunk and not self.recurrent[i]
                else None for i in range(self.n_layers)]

    def recurrent_spec(self, i: int):
        return self.delta_net if i < len(self.recurrent) and self.recurrent[i] else None

    @property
    def delta_net(self) -> DeltaNetSpec:
        return DeltaNetSpec(self.n_k_heads, self.n_v_heads, self.ssm_state, self.conv_kernel,
                            self.norm_eps)


@dataclass(frozen=True)
class AttnWeights:
    """A gated full-attention layer: queries and their gates split from attn_q's rows."""
    attn_norm: object
    wq: object
    wq_gate: object
    wk: object
    wv: object
    wo: object
    q_norm: object
    k_norm: object
    ffn: dict


@dataclass(frozen=True)
class DeltaNetLayer:
    """A DeltaNet layer's tensors."""
    attn_norm: object
    wqkv: object       # mixed q, k, v channels (conv_channels, dim)
    wz: object         # the output gate (attn_gate)
    wbeta: object
    walpha: object
    small: DeltaNetWeights
    ssm_norm: object
    wout: object
    ffn: dict


def rope_freq_factors(n_rot: int, sections: tuple):
    """Divisors of the rotated pairs' frequencies for text tokens under llama.cpp's
    interleaved multimodal RoPE: pairs that take the fourth section's position (0 for
    text) are left unrotated (a huge divisor); None when every pair rotates by the token's
    position."""
    secs = list(sections) + [0] * (4 - len(sections))
    total = sum(secs)
    if total <= 0:
        return None
    unrotated = []
    for i in range(n_rot // 2):
        sector = i % total
        t = sector % 3 == 0 and sector < 3 * secs[0]
        h = sector % 3 == 1 and sector < 3 * secs[1]
        w = sector % 3 == 2 and sector < 3 * secs[2]
        unrotated.append(not (t or h or w))
    if not any(unrotated):
        return None
    import numpy as np
    return np.where(np.array(unrotated), 1e30, 1.0).astype(np.float32)


class Model(Net):
    """Qwen3.5's trunk layers placed as the loader's placement says."""

    def __init__(self, args: ModelArgs, w: WeightLoader, ctx: int = 0):
        self.args = a = args
        self.be = w.placement.embed
        self.head_be = w.placement.head
        self.rope = RopeSpec(a.n_rot, a.rope_theta, True, a.rope_scale,
                             rope_freq_factors(a.n_rot, a.rope_sections))
        self.tok_embd = w.embedding("token_embd.weight", a.vocab_size, a.dim)
        self.layers = []
        for i in range(len(a.recurrent)):
            be = w.placement.layers[i]
            if a.recurrent[i]:
                if not be.recurrent:
                    raise ModelError(f"the {be.name} backend does not run Qwen3.5's linear "
                                     "attention layers yet; run them on the CPU (-ngl 0)")
                weights = self.load_delta_net(w, i)
                spec = BlockSpec(0, 0, 0, a.norm_eps, self.rope, 0.0, recurrent=a.delta_net)
            else:
                weights = self.load_attention(w, i)
                spec = BlockSpec(a.n_heads, a.n_kv_heads, a.head_dim, a.norm_eps, self.rope,
                                 1.0 / math.sqrt(a.head_dim))
            if weights.ffn.get("moe") is not None:  # qwen35moe: renormalised top-k
                spec = replace(spec, moe=moe.spec(a, True))
            self.layers.append(PlacedLayer(i, be, weights, spec))
        self.out_norm = w.vector("output_norm.weight", a.dim)
        name = "output.weight" if w.has("output.weight") else "token_embd.weight"
        self.output = w.matrix(name, a.vocab_size, a.dim, head=True)

    # ---- loading

    def load_ffn(self, w: WeightLoader, i: int) -> dict:
        p = f"blk.{i}."
        return {"norm": w.vector(p + "post_attention_norm.weight", self.args.dim),
                **llama.load_ffn(w, i, self.args)}

    def load_attention(self, w: WeightLoader, i: int) -> AttnWeights:
        a, p = self.args, f"blk.{i}."
        hd = a.head_dim
        name = p + "attn_q.weight"
        q_rows = [2 * h * hd + j for h in range(a.n_heads) for j in range(hd)]
        g_rows = [r + hd for r in q_rows]
        w._info(name, (2 * a.n_heads * hd, a.dim))
        kvd = a.n_kv_heads * hd
        return AttnWeights(
            attn_norm=w.vector(p + "attn_norm.weight", a.dim),
            wq=w.matrix_rows(name, a.dim, q_rows), wq_gate=w.matrix_rows(name, a.dim, g_rows),
            wk=w.matrix(p + "attn_k.weight", kvd, a.dim),
            wv=w.matrix(p + "attn_v.weight", kvd, a.dim),
            wo=w.matrix(p + "attn_output.weight", a.dim, a.n_heads * hd),
            q_norm=w.vector(p + "attn_q_norm.weight", hd),
            k_norm=w.vector(p + "attn_k_norm.weight", hd),
            ffn=self.load_ffn(w, i))

    def load_delta_net(self, w: WeightLoader, i: int) -> DeltaNetLayer:
        a, p = self.args, f"blk.{i}."
        s = a.delta_net
        C, Hv, vd = s.conv_channels, a.n_v_heads, a.ssm_inner
        return DeltaNetLayer(
            attn_norm=w.vector(p + "attn_norm.weight", a.dim),
            wqkv=w.matrix(p + "attn_qkv.weight", C, a.dim),
            wz=w.matrix(p + "attn_gate.weight", vd, a.dim),
            wbeta=w.matrix(p + "ssm_beta.weight", Hv, a.dim),
            walpha=w.matrix(p + "ssm_alpha.weight", Hv, a.dim),
            small=DeltaNetWeights(w.host_matrix(p + "ssm_conv1d.weight", C, a.conv_kernel),
                                  w.host_vector(p + "ssm_dt.bias", Hv),
                                  w.host_vector(p + "ssm_a", Hv)),
            ssm_norm=w.vector(p + "ssm_norm.weight", a.ssm_state),
            wout=w.matrix(p + "ssm_out.weight", a.dim, vd),
            ffn=self.load_ffn(w, i))

    # ---- the layers

    def attention_mixer(self, be, h, w: AttnWeights, s: BlockSpec, positions, kv: KVBatch):
        q, gate, k, v = be.linear(h, [w.wq, w.wq_gate, w.wk, w.wv])
        q = be.rope(be.head_norm(q, s.n_heads, w.q_norm, s.norm_eps), s.n_heads, positions,
                    s.rope)
        k = be.rope(be.head_norm(k, s.n_kv_heads, w.k_norm, s.norm_eps), s.n_kv_heads,
                    positions, s.rope)
        o = be.attention(q, k, v, kv, positions, s.n_heads, s.attn_scale)
        return be.linear(be.glu(gate, o, "sigmoid"), [w.wo])[0]

    def delta_net_mixer(self, be, h, w: DeltaNetLayer, s: BlockSpec, kv: KVBatch):
        qkv, z, beta, alpha = be.linear(h, [w.wqkv, w.wz, w.wbeta, w.walpha])
        o = be.delta_net(qkv, alpha, beta, w.small, s.recurrent, kv)
        o = be.head_norm(o, s.recurrent.n_v_heads, w.ssm_norm, s.norm_eps)
        return be.linear(be.glu(z, o, "silu"), [w.wout])[0]

    def block(self, be, x, w, s: BlockSpec, positions, kv: KVBatch):
        if be.fused_blocks and be.recurrent and w.ffn.get("moe") is None:
            return be.decoder_block(x, w, s, positions, kv)  # the block natively
        h = be.rms_norm(x, w.attn_norm, s.norm_eps)
        if s.recurrent is not None:
            o = self.delta_net_mixer(be, h, w, s, kv)
        else:
            o = self.attention_mixer(be, h, w, s, positions, kv)
        x = be.add(x, o)
        f = w.ffn
        h = be.rms_norm(x, f["norm"], s.norm_eps)
        experts = f.get("moe")
        if experts is not None and experts.backend is not None:  # the experts live elsewhere
            home = experts.backend
            y = be.from_numpy(home.to_numpy(home.moe_ffn(home.from_numpy(be.to_numpy(h)),
                                                         experts, s.moe)))
        elif experts is not None:
            y = be.moe_ffn(h, experts, s.moe)
        else:
            gate, up = be.linear(h, [f["w_gate"], f["w_up"]])
            y = be.linear(be.glu(gate, up, s.activation), [f["w_down"]])[0]
        return be.add(x, y)

    def forward(self, ids, positions, kv: KVBatch, logit_rows, hidden: bool = False):
        x = self.embed(ids)
        be = self.be
        for layer in self.layers:
            if layer.backend is not be:
                x = layer.backend.from_numpy(be.to_numpy(x))
                be = layer.backend
            x = self.block(be, x, layer.weights, layer.spec, positions, kv.layer(layer.index))
        if len(logit_rows) == 0:
            return None
        if self.head_be is not be:
            x = self.head_be.from_numpy(be.to_numpy(x))
        hb = self.head_be
        x = hb.rms_norm(hb.select_rows(x, logit_rows), self.out_norm, self.args.norm_eps)
        if hidden:
            return hb.to_numpy(x)
        return hb.to_numpy(hb.linear(x, [self.output])[0])


__all__ = ["ModelArgs", "Model"]
