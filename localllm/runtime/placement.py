"""Where a model's layers run and the memory they take: the split of layers between the CPU
backend and a GPU backend (``-ngl``: the last N layers and the output head on the GPU, as
llama.cpp places them), and the ledger of weights, KV cache and scratch per device, planned
from the file's tensor table before anything is allocated.
"""

from __future__ import annotations

import importlib.util
import platform
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from localllm.backends.base import Backend, KVLayout
from localllm.models.common import Placement, tensor_override
from localllm.errors import BadSetting, NotEnoughMemory
from localllm.runtime.recurrent import states_held

BACKENDS = ("auto", "cpu", "torch", "mlx")
GPU_MARGIN = 512 << 20    # left free on a GPU of its own: driver context, allocator slack
HOST_MARGIN = 256 << 20   # left free on the host when the KV pool is sized
POOL_CONTEXTS = 2         # default KV pool: this many full contexts, as memory allows
_LAYER = re.compile(r"blk\.(\d+)\.")
_GIB = 1 << 30


def parse_gpu_layers(value: Any) -> int | str:
    """``-ngl``'s value: a layer count (>= 0), 'auto' or 'all'.

    Raises:
        BadSetting: anything else.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    text = str(value).strip().lower()
    if text in ("auto", "all"):
        return text
    if text.isdigit():
        return int(text)
    raise BadSetting(f"--gpu-layers must be a number of layers, 'auto' or 'all', got {value!r}",
                     param="gpu_layers")


# An expert stack's name, as llama.cpp's --cpu-moe and --n-cpu-moe match it.
EXPERTS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_GPU_NAMES = re.compile(r"(gpu|cuda\d*|metal|mtl\d*|torch|mlx)", re.IGNORECASE)


def tensor_rules(override_tensor=(), cpu_moe: bool = False, n_cpu_moe: int = 0) -> tuple:
    """The tensor placement rules, (regex, 'cpu' or 'gpu') in the order they are tried:
    ``-ot REGEX=BACKEND`` values first (each may hold several, comma-separated, as
    llama.cpp's), then ``--cpu-moe`` (every expert stack on the CPU) and ``--n-cpu-moe N``
    (the experts of layers 0..N-1).

    Raises:
        BadSetting: a rule without '=', a bad regex, an unknown backend or a negative N.
    """
    rules = []
    for value in override_tensor:
        for item in str(value).split(","):
            pattern, sep, dev = item.strip().rpartition("=")
            if not sep or not pattern:
                raise BadSetting(f"--override-tensor takes REGEX=BACKEND, got {item!r}",
                                 param="override_tensor")
            try:
                re.compile(pattern)
            except re.error as e:
                raise BadSetting(f"--override-tensor: {pattern!r} is not a regular expression "
                                 f"({e})", param="override_tensor") from None
            if dev.strip().lower() == "cpu":
                rules.append((pattern, "cpu"))
            elif _GPU_NAMES.fullmatch(dev.strip()):
                rules.append((pattern, "gpu"))
            else:
                raise BadSetting(f"--override-tensor: unknown backend {dev!r} (CPU, or the GPU "
                                 "as GPU, CUDA0, Metal, torch or mlx)", param="override_tensor")
    if cpu_moe:
        rules.append((EXPERTS, "cpu"))
    if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
        raise BadSetting(f"--n-cpu-moe must be a number of layers >= 0, got {n_cpu_moe!r}",
                         param="n_cpu_moe")
    rules += [(rf"blk\.{i}{EXPERTS}", "cpu") for i in range(n_cpu_moe)]
    return tuple(rules)


def _nvidia_present() -> bool:
    # Seen without importing torch (seconds), so a CPU-only run stays quick to start.
    return Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidiactl").exists()


def resolve_backend(name: str) -> str:
    """The GPU backend to use: 'auto' is torch when CUDA is available, else MLX on Apple
    Silicon, else 'cpu' (no GPU backend).

    Raises:
        BadSetting: an unknown name, or a backend whose package is not installed.
    """
    if name not in BACKENDS:
        raise BadSetting(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})",
                         param="backend")
    if name == "auto":
        if importlib.util.find_spec("torch") is not None and _nvidia_present():
            from localllm.backends.torch import cuda_available
            if cuda_available():
                return "torch"
        # Importing MLX starts its threads (and costs decode speed) even where it has no GPU:
        # only on Apple Silicon is it worth asking.
        if (platform.system() == "Darwin" and platform.machine() == "arm64"
                and importlib.util.find_spec("mlx") is not None):
            from localllm.backends.mlx import metal_available
            if metal_available():
                return "mlx"
        return "cpu"
    extra = {"torch": "torch", "mlx": "mlx"}.get(name)
    if extra and importlib.util.find_spec(extra) is None:
        hint = ('pip install torch==2.13.0 (a CPU build) or pip install -e ".[torch]"'
                if extra == "torch" else 'pip install -e ".[mlx]" (or "mlx[cpu]" off macOS)')
        raise BadSetting(f"the {name} backend needs the {extra} package: {hint}",
                         param="backend")
    return name


def make_gpu_backend(name: str, threads: int) -> Backend | None:
    """The GPU backend object for a resolved name ('cpu': None)."""
    if name == "torch":
        from localllm.backends.torch import TorchBackend
        from .process import set_torch_threads
        be = TorchBackend()
        if be.device == "cpu":
            set_torch_threads(threads)
        return be
    if name == "mlx":
        from localllm.backends.mlx import MlxBackend
        return MlxBackend()
    return None


@dataclass
class DevicePlan:
    """What one backend will hold."""
    backend: Backend
    pool: str                   # the memory it allocates from (backends may share one)
    layers: list = field(default_factory=list)
    head: bool = False
    weight_bytes: int = 0       # anonymous: the backend's own copies
    kv_per_token: int = 0       # KV bytes per token over its layers
    scratch_bytes: int = 0      # activations of one batch, logits, dequantization scratch
    largest: int = 0            # elements of its largest matrix
    expert_bytes: int = 0       # the experts' (ffn_*_exps), anonymous or file-backed
    file_bytes: int = 0         # file-backed: pages of the mapped GGUF read in place
    state_bytes: int = 0        # recurrent layers' states: one per sequence and snapshots

    @property
    def label(self) -> str:
        return f"{self.backend.name} ({self.backend.device})"


@dataclass
class MemoryPlan:
    """The ledger: per device, weights, KV for the pool, scratch; and the split it implies."""
    n_layers: int
    gpu_layers: int
    ctx: int
    pool_tokens: int
    k_type: str
    v_type: str
    devices: list             # DevicePlan, the CPU's first
    free: dict                # pool -> free bytes when planned
    rules: tuple = ()         # tensor placement rules (tensor_rules)
    states: int = 0           # recurrent states the plan holds room for (0: no such layers)

    def kv_bytes(self, d: DevicePlan) -> int:
        return self.pool_tokens * d.kv_per_token

    def total(self, d: DevicePlan) -> int:
        return d.weight_bytes + self.kv_bytes(d) + d.scratch_bytes + d.state_bytes

    def placement(self) -> Placement:
        """The Placement the plan describes (the embedding on the CPU)."""
        cpu = self.devices[0].backend
        layers = [cpu] * self.n_layers
        head = cpu
        for d in self.devices:
            for i in d.layers:
                layers[i] = d.backend
            if d.head:
                head = d.backend
        kinds = {"cpu": cpu, "gpu": self.devices[-1].backend}
        return Placement(cpu, tuple(layers), head,
                         tuple((pattern, kinds[kind]) for pattern, kind in self.rules))

    def summary(self) -> str:
        """Where the layers run in a few words: 'cpu', or e.g. 'torch (cuda:0) 20/30 layers
        + cpu'."""
        if self.gpu_layers == 0:
            return "cpu"
        rest = " + cpu" if self.gpu_layers < self.n_layers else ""
        if self.devices[0].expert_bytes and self.devices[-1].expert_bytes == 0:
            rest = " + experts on cpu"
        elif self.devices[0].expert_bytes and self.gpu_layers == self.n_layers:
            rest = " + some experts on cpu"
        return f"{self.devices[1].label} {self.gpu_layers}/{self.n_layers} layers{rest}"

    def format(self) -> str:
        """The ledger as a table (``llm inspect --plan``, ``llm run -v``)."""
        mib = 1 << 20
        gpu = self.devices[1].label if len(self.devices) > 1 else "no GPU backend"
        lines = [f"memory plan: {self.gpu_layers}/{self.n_layers} layers on the GPU ({gpu}), "
                 f"context {self.ctx}, KV {self.k_type}/{self.v_type}, KV pool "
                 f"{self.pool_tokens} tokens",
                 f"  {'device':22s} {'layers':>12s} {'weights':>11s} {'experts':>11s} "
                 f"{'KV':>11s} {'scratch':>11s} {'total':>11s} {'free':>11s} {'mapped':>11s}"]
        for d in self.devices:
            span = _span(d.layers) + (" +head" if d.head else "")
            lines.append(f"  {d.label:22s} {span or '-':>12s} {d.weight_bytes / mib:8.1f} MiB "
                         f"{d.expert_bytes / mib:7.1f} MiB "
                         f"{self.kv_bytes(d) / mib:7.1f} MiB {d.scratch_bytes / mib:7.1f} MiB "
                         f"{self.total(d) / mib:7.1f} MiB "
                         f"{self.free.get(d.pool, 0) / mib:7.0f} MiB "
                         f"{d.file_bytes / mib:7.1f} MiB")
        for d in self.devices:
            if d.state_bytes:
                lines.append(f"  {d.label}: room for {self.states} recurrent states of "
                             f"{d.state_bytes / self.states / mib:.1f} MiB (each sequence's "
                             f"own and its snapshots, and released ones kept for reuse): "
                             f"{d.state_bytes / mib:.1f} MiB, in its total")
        lines.append("  total: anonymous memory (weights, KV, scratch, states); mapped: pages of "
                     "the model file read in place (page cache), outside total")
        return "\n".join(lines)


def _span(layers: list) -> str:
    if not layers:
        return ""
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


@dataclass(frozen=True)
class PlanRequest:
    """What the ledger is planned for."""
    ctx: int
    k_type: str = "f16"
    v_type: str = "f16"
    block_size: int = 16
    batch_size: int = 256
    kv_pool_mb: float = 0
    gpu_layers: int | str = "auto"
    kv_contexts: int = POOL_CONTEXTS   # full contexts the default pool aims at, as memory allows
    rules: tuple = ()                  # tensor placement rules (tensor_rules)


def _device_plans(tensors, args, pools: list, n_gpu: int, req: PlanRequest) -> list:
    """Weights, KV per token and scratch of each backend ((backend, pool) pairs, the CPU's
    first) with the last n_gpu layers on the second."""
    n = args.n_layers
    first_gpu = n - n_gpu
    host = pools[0][1]
    devs = [DevicePlan(be, pool) for be, pool in pools]
    gpu = devs[1] if len(devs) > 1 else None
    head = gpu if gpu is not None and n_gpu > 0 else devs[0]
    head.head = True
    for i in range(n):
        devs[1 if i >= first_gpu and gpu is not None else 0].layers.append(i)
    kv, rec = _layer_memory(args)
    for d in devs:
        block = 0
        for i in d.layers:
            if kv[i] is not None:
                layout = KVLayout(*kv[i], req.block_size, req.k_type, req.v_type)
                block += d.backend.kv_block_nbytes(layout)
            if rec[i] is not None:  # room for the states its sequences and snapshots hold
                d.state_bytes += states_held(req.kv_contexts) \
                    * d.backend.recurrent_state_nbytes(rec[i])
        d.kv_per_token = block // req.block_size
    tied = "output.weight" not in tensors
    for name, t in tensors.items():
        m = _LAYER.match(name)
        kind = tensor_override(name, req.rules)
        if kind is not None:
            d = devs[0] if kind == "cpu" or gpu is None else gpu
        elif m:
            d = devs[1] if gpu is not None and int(m.group(1)) >= first_gpu else devs[0]
        elif name.startswith("output") or (name == "token_embd.weight" and tied):
            d = head
        else:
            # the embedding's rows are read from the mapped file on lookup
            devs[0].file_bytes += int(t.nbytes) if name == "token_embd.weight" else 0
            continue
        if len(t.shape) == 2 and int(t.shape[1]) % 32 == 0:
            N, K = (int(s) for s in t.shape)
            d.weight_bytes += d.backend.plan_matrix_nbytes(t.type_name, N, K)
            d.largest = max(d.largest, N * K)
        elif len(t.shape) == 3:  # a stack of experts, copied or read from the file in place
            E, N, K = (int(s) for s in t.shape)
            anon, mapped = d.backend.plan_experts_nbytes(t.type_name, E, N, K)
            if d.pool != host:  # only the host's memory holds the file's pages
                anon, mapped = anon + mapped, 0
            d.weight_bytes += anon
            d.file_bytes += mapped
            d.expert_bytes += anon + mapped
            d.largest = max(d.largest, N * K)
        else:  # vectors, and small tables such as a DeltaNet's conv kernel (float32)
            d.weight_bytes += 4 * int(t.n_elements)
    B = req.batch_size
    widths = 3 * args.dim + 2 * args.n_heads * args.head_dim \
        + 2 * args.n_kv_heads * args.head_dim + 3 * args.hidden_dim
    for d in devs:
        if d.layers or d.head:
            scores = 2 * args.n_heads * B * req.ctx  # a chunk's scores over the context
            d.scratch_bytes = 4 * (B * widths + scores) + d.backend.plan_scratch_nbytes(d.largest)
    logits = 4 * B * args.vocab_size
    head.scratch_bytes += logits
    if head is not devs[0]:
        devs[0].scratch_bytes += logits  # copied to the host
    return devs


def _layer_memory(args) -> tuple[list, list]:
    """Per layer, the (KV heads, head size) of its pages or None, and its DeltaNetSpec or
    None (the model's ``kv_layers``/``recurrent_spec``; an encoder's args have neither: every
    layer at its one size, none recurrent)."""
    n = args.n_layers
    if not hasattr(args, "kv_layers"):
        return [(args.n_kv_heads, args.head_dim)] * n, [None] * n
    return args.kv_layers(), [args.recurrent_spec(i) for i in range(n)]


def _needs(devs: list, ctx: int) -> dict:
    """Bytes each pool needs for weights, scratch and one full context of KV."""
    need: dict[str, int] = {}
    for d in devs:
        need[d.pool] = need.get(d.pool, 0) + d.weight_bytes + d.scratch_bytes \
            + d.state_bytes + ctx * d.kv_per_token
    return need


def plan_memory(tensors, args, cpu: Backend, gpu: Backend | None, req: PlanRequest,
                free: dict | None = None) -> MemoryPlan:
    """Plan a model's memory before loading it.

    Args:
        tensors: the file's tensor table (name -> info with shape, type_name, n_elements).
        args: the architecture's ModelArgs.
        cpu: the CPU backend; gpu: the GPU backend, or None.
        req: context, KV types, batch and the requested split.
        free: pool -> free bytes (None: asked of the backends now).
    Returns:
        The MemoryPlan.
    Raises:
        NotEnoughMemory: the model does not fit (the message names the numbers), or a
            requested split puts more on the GPU than it has free.
        BadSetting: a KV pool limit smaller than one context.
    """
    n = args.n_layers
    infos = [be.memory_info() for be in (cpu, gpu) if be is not None]
    host = infos[0].pool
    pools = [(be, info.pool) for be, info in zip((cpu, gpu), infos)]
    if free is None:
        free = {}
        for info in infos:
            free.setdefault(info.pool, info.free)
    want = parse_gpu_layers(req.gpu_layers)
    stay = [i for i, r in enumerate(_layer_memory(args)[1]) if r is not None] \
        if gpu is not None and not gpu.recurrent else []
    if gpu is None or stay and want == "auto":
        n_gpu = 0  # the GPU backend cannot run the recurrent layers: the CPU runs them all
    elif want == "all":
        n_gpu = n
    elif want == "auto":
        n_gpu, req = _auto_split(tensors, args, pools, req, free, host)
    else:
        n_gpu = min(int(want), n)
    if stay and n_gpu and stay[-1] >= n - n_gpu:
        raise BadSetting(f"the {gpu.name} backend does not run linear-attention (recurrent) "
                         f"layers, and {n_gpu} GPU layers take layer {stay[-1]}; the last "
                         f"{n - 1 - stay[-1]} layers at most can go there (or -ngl 0)",
                         param="gpu_layers")
    devs = _device_plans(tensors, args, pools, n_gpu, req)
    _check(devs, req, free, host, n_gpu, n)
    per_token = sum(d.kv_per_token for d in devs)
    if req.kv_pool_mb:
        tokens = int(req.kv_pool_mb * (1 << 20)) // per_token
        if tokens < req.ctx:
            raise BadSetting(
                f"--kv-pool-mb {req.kv_pool_mb:g} holds {tokens} tokens of KV, less than the "
                f"{req.ctx}-token context ({req.ctx * per_token / (1 << 20):.1f} MB); raise it "
                "or lower --ctx-size", param="kv_pool_mb")
    else:
        tokens = max(1, req.kv_contexts) * req.ctx
        for pool in {d.pool for d in devs}:
            mine = [d for d in devs if d.pool == pool]
            pt = sum(d.kv_per_token for d in mine)
            if pt:
                used = sum(d.weight_bytes + d.scratch_bytes + d.state_bytes for d in mine)
                margin = HOST_MARGIN if pool == host else GPU_MARGIN
                tokens = min(tokens, (free[pool] - used - margin) // pt)
        tokens = max(req.ctx, tokens)
    return MemoryPlan(n, n_gpu, req.ctx, tokens, req.k_type, req.v_type, devs, dict(free),
                      tuple((p, "cpu" if gpu is None else k) for p, k in req.rules),
                      states_held(req.kv_contexts) if any(d.state_bytes for d in devs) else 0)


def _auto_split(tensors, args, pools, req: PlanRequest, free: dict, host: str):
    """``-ngl auto``: (layers on the GPU, the request with the rules that fill it).

    Every layer if all of it fits. A mixture-of-experts model then keeps its attention, norms,
    dense FFNs and KV on the GPU first and moves experts to the CPU from the first layer on
    (as --n-cpu-moe N, the smallest N that fits); if even no expert fits, the experts stay on
    the CPU and whole layers leave the GPU from the first. Rules the user gave are tried
    before these, so they still decide the tensors they name.
    """
    n = args.n_layers

    def fits(k, r):
        return _gpu_fits(_device_plans(tensors, args, pools, k, r), r.ctx, free, host)

    if fits(n, req):
        return n, req
    if any(len(t.shape) == 3 for name, t in tensors.items() if _LAYER.match(name)):
        for m in range(1, n + 1):
            r = replace(req, rules=req.rules + tensor_rules(n_cpu_moe=m))
            if fits(n, r):
                return n, r
        req = replace(req, rules=req.rules + tensor_rules(cpu_moe=True))
    return next((k for k in range(n - 1, 0, -1) if fits(k, req)), 0), req


def _gpu_fits(devs, ctx, free, host) -> bool:
    """Whether the GPU's pool holds what the plan puts in it (with the margin where it is a
    GPU's own memory; a pool shared with the host must hold everything)."""
    pool = devs[1].pool
    return _needs(devs, ctx)[pool] + (0 if pool == host else GPU_MARGIN) <= free[pool]


def _check(devs, req: PlanRequest, free: dict, host: str, n_gpu: int, n: int) -> None:
    need = _needs(devs, req.ctx)
    for d in devs[1:]:
        if d.pool != host and need[d.pool] + GPU_MARGIN > free[d.pool]:
            raise NotEnoughMemory(
                f"not enough memory on {d.backend.device}: {n_gpu} of {n} layers need "
                f"{d.weight_bytes / _GIB:.2f} GiB for weights, "
                f"{req.ctx * d.kv_per_token / _GIB:.2f} GiB for a {req.ctx}-token KV cache and "
                f"{d.scratch_bytes / _GIB:.2f} GiB of scratch, {free[d.pool] / _GIB:.2f} GiB "
                f"is free ({GPU_MARGIN >> 20} MiB kept spare); try fewer --gpu-layers or "
                f"--gpu-layers auto", param="gpu_layers")
    mine = [d for d in devs if d.pool == host]
    if need.get(host, 0) > free[host]:
        weights = sum(d.weight_bytes for d in mine)
        mapped = sum(d.file_bytes for d in mine)
        beside = (f" (beside {mapped / _GIB:.2f} GiB read from the model file in place)"
                  if mapped else "")
        kv = req.ctx * sum(d.kv_per_token for d in mine)
        scratch = sum(d.scratch_bytes for d in mine)
        states = sum(d.state_bytes for d in mine)
        scratch_states = (f"{scratch / _GIB:.2f} GiB of scratch" + (
            f", {states / _GIB:.2f} GiB of recurrent states" if states else ""))
        where = (f" beside {n_gpu} layers on {devs[1].backend.device}"
                 if n_gpu and devs[1].pool != host else "")
        hint = " (try a smaller --ctx-size)" if kv > free[host] // 4 else ""
        raise NotEnoughMemory(
            f"not enough memory: the model needs {weights / _GIB:.2f} GiB of its own for "
            f"weights{beside} and "
            f"{kv / _GIB:.2f} GiB for a {req.ctx}-token KV cache (and {scratch_states})"
            f"{where}, {free[host] / _GIB:.2f} GiB is available{hint}",
            param="ctx_size" if hint else None)
