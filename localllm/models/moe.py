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
    return w.has(f"blk.{i}.ffn_gate_exps.weight") or w.has(f"blk.{i}.ffn_gate_up_exps.weight")


def gate_up(w: WeightLoader, p: str, E: int, F: int, D: int) -> tuple:
    """A layer's gate and up expert stacks, from two tensors or from one fused
    ``ffn_gate_up_exps`` (each expert's F gate rows, then its F up rows)."""
    if w.has(p + "ffn_gate_up_exps.weight"):
        return w.experts_split(p + "ffn_gate_up_exps.weight", E, F, D)
    return (w.experts(p + "ffn_gate_exps.weight", E, F, D),
            w.experts(p + "ffn_up_exps.weight", E, F, D))


def down_scale(w: WeightLoader, p: str, E: int):
    """The scale on each expert's down output (``ffn_down_exps.scale``, Gemma 4's
    per_expert_scale) as float32 on the host, or None.

    Raises:
        ModelError: a scale that is not finite and positive, or one beside down biases
            (which it would scale too, folded into the routing weights).
    """
    name = p + "ffn_down_exps.scale"
    if not w.has(name):
        return None
    if w.has(p + "ffn_down_exps.bias"):
        raise ModelError(f"tensor {name!r} beside expert biases is not supported")
    s = w.host_vector(name, E)
    if not (s > 0).all():
        raise ModelError(f"tensor {name!r} holds scales that are not positive")
    return s


def expert_home(w: WeightLoader, p: str, i: int):
    """The backend of a layer's experts, which must all be on one.

    Raises:
        ModelError: gate, up and down placed apart (by tensor overrides).
    """
    names = [p + f"ffn_{x}_exps.weight" for x in ("gate_up", "gate", "up", "down")]
    homes = {id(w.backend_for(n)): w.backend_for(n) for n in names if w.has(n)}
    if len(homes) != 1:
        raise ModelError(f"layer {i}: its gate, up and down experts must be placed on one "
                         "backend (check the tensor overrides)")
    return next(iter(homes.values()))


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
    home = expert_home(w, p, i)
    gate, up = gate_up(w, p, E, F, D)
    return MoEWeights(router=w.matrix(p + "ffn_gate_inp.weight", E, D), gate=gate, up=up,
                      down=w.experts(p + "ffn_down_exps.weight", E, D, F),
                      backend=None if home is w.backend_for(p + "attn_norm.weight") else home,
                      down_scale=down_scale(w, p, E), **shared)


def spec(a, norm: bool, activation: str = "silu", gating: str = "softmax") -> MoESpec:
    """The routing of a model's expert layers (softmax gating unless the architecture says
    otherwise, as llama.cpp runs them; ``norm``: the architecture renormalises the top-k
    weights)."""
    return MoESpec(a.n_experts, a.n_experts_used, gating, norm, 0.0, activation)
