"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention with QK-norm, and
mixture-of-experts FFNs routed by a softmax over the experts, the top-k weights renormalised,
with no shared expert."""

from __future__ import annotations

from . import qwen3

ModelArgs = qwen3.ModelArgs


class Model(qwen3.Model):
    moe_norm = True
