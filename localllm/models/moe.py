"""Mixture-of-experts feed-forward layers as llama-family files store them: a router
(``ffn_gate_inp``), stacked experts (``ffn_{gate,up,down}_exps``) and optionally a shared
expert (``ffn_*_shexp``) with its gate (``ffn_gate_inp_shexp``); the ``{arch}.expert_*``
metadata that sizes them."""

from __future__ import annotations

from localllm.backends.base import MoESpec, MoEWeights

from .common import ModelError, WeightLoader, meta_int


def args_from_gguf(meta: dict, arch: str) -> dict:
    """The ModelArgs fields of the experts (all 0 for a dense model)."""
    p = f"{arch}."
    n = meta_int(meta, p + "expert_count", 0)
    if n == 0:
        return {}
    ff = meta_int(meta, p + "feed_forward_length", 0)
    expert_ff = meta_int(meta, p + "expert_feed_forward_length", ff)
    return {"n_experts": n, "n_experts_used": meta_int(meta, p + "expert_used_count", 0),
            "expert_hidden_dim": expert_ff,
            "shared_hidden_dim": meta_int(meta, p + "expert_shared_feed_forward_length", ff)}


def check_args(a) -> None:
    """Raises ModelError, naming the key, for expert counts no model can run with."""
    if a.n_experts == 0:
        return
    if not 0 < a.n_experts_used <= a.n_experts:
        raise ModelError(f"metadata '{a.arch}.expert_used_count' is {a.n_experts_used}; it "
                         f"must be between 1 and '{a.arch}.expert_count' ({a.n_experts})")
    if not a.expert_hidden_dim > 0:
        raise ModelError(f"metadata '{a.arch}.expert_feed_forward_length' must be positive, "
                         f"got {a.expert_hidden_dim}")


def has_experts(w: WeightLoader, i: int) -> bool:
    """Whether layer i's feed-forward is a mixture of experts."""
    return w.has(f"blk.{i}.ffn_gate_exps.weight")


def load(w: WeightLoader, i: int, a) -> MoEWeights:
    """Layer i's router, experts and shared expert (where the file has one).

    Raises:
        ModelError: experts without expert metadata, or tensors of the wrong shape.
    """
    p = f"blk.{i}."
    if a.n_experts == 0:
        raise ModelError(f"layer {i} has experts but metadata '{a.arch}.expert_count' is "
                         "missing")
    E, F, D = a.n_experts, a.expert_hidden_dim, a.dim
    shared = {}
    if w.has(p + "ffn_up_shexp.weight"):
        S = a.shared_hidden_dim
        shared = {"shared_gate": w.matrix(p + "ffn_gate_shexp.weight", S, D),
                  "shared_up": w.matrix(p + "ffn_up_shexp.weight", S, D),
                  "shared_down": w.matrix(p + "ffn_down_shexp.weight", D, S)}
        if w.has(p + "ffn_gate_inp_shexp.weight"):
            shared["shared_gate_inp"] = w.row_matrix(p + "ffn_gate_inp_shexp.weight", D)
    home = w.backend_for(p + "ffn_gate_exps.weight")
    if any(w.backend_for(p + f"ffn_{x}_exps.weight") is not home for x in ("up", "down")):
        raise ModelError(f"layer {i}: its gate, up and down experts must be placed on one "
                         "backend (check the tensor overrides)")
    return MoEWeights(router=w.matrix(p + "ffn_gate_inp.weight", E, D),
                      gate=w.experts(p + "ffn_gate_exps.weight", E, F, D),
                      up=w.experts(p + "ffn_up_exps.weight", E, F, D),
                      down=w.experts(p + "ffn_down_exps.weight", E, D, F),
                      backend=None if home is w.backend_for(p + "attn_norm.weight") else home,
                      **shared)


def spec(a, norm: bool, activation: str = "silu", gating: str = "softmax") -> MoESpec:
    """The routing of a model's expert layers (softmax gating unless the architecture says
    otherwise, as llama.cpp runs them; ``norm``: the architecture renormalises the top-k
    weights)."""
    return MoESpec(a.n_experts, a.n_experts_used, gating, norm, 0.0, activation)
