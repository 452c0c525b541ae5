"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention with q/k/v biases, and
mixture-of-experts FFNs whose top-k softmax weights are not renormalised, plus a shared
expert scaled by the sigmoid of its own gate."""

from __future__ import annotations

from . import qwen2

ModelArgs = qwen2.ModelArgs


class Model(qwen2.Model):
    moe_norm = False
