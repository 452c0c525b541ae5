"""The Backend protocol: what a model's layer math may ask of the device it is placed on.

Arrays are the backend's own (numpy for the CPU); models pass them back unchanged and never
touch numpy, torch or mlx themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence


@dataclass(frozen=True)
class RopeSpec:
    """How one layer rotates queries and keys."""
    n_rot: int                 # rotated dims per head (from the front)
    theta: float               # frequency base
    neox: bool                 # pair i with i + n_rot/2 (True) or 2i with 2i+1 (False)
    pos_scale: float = 1.0     # linear position scaling (1 / factor)
    freq_factors: Any = None   # optional per-frequency divisors (rope_freqs tensor), numpy
    mscale: float = 1.0        # cos and sin multiplied by this ({arch}.rope.scaling.attn_factor)
    yarn: tuple | None = None  # YaRN's (ext_factor, low, high) blend (kernels.ops.rope_tables)
    # queries only (llama 4's attention temperature): cos and sin of position p also times
    # log(floor(p / temp_floor) + 1) * temp_scale + 1; 0: none
    temp_scale: float = 0.0
    temp_floor: int = 0


@dataclass(frozen=True)
class MoESpec:
    """How one mixture-of-experts layer routes (models/moe.py reads it from the metadata)."""
    n_experts: int
    n_used: int                # experts per token (top-k)
    # router probabilities: 'softmax', 'sigmoid', or 'softmax_weight' (top-k by logit, then
    # a softmax over the k chosen: gpt-oss)
    gating: str = "softmax"
    norm: bool = False         # divide the k chosen weights by their sum
    scale: float = 0.0         # factor on the weights (0 or 1: none)
    activation: str = "silu"   # the experts' gated activation (glu's, or 'swiglu_oai')


@dataclass(frozen=True)
class MoEWeights:
    """One mixture-of-experts FFN as uploaded: the router (n_experts out, dim in), the
    experts (``upload_experts``: n_experts matrices each), and an optional shared expert
    with an optional gate (1 out, dim in) whose sigmoid scales it. gpt-oss adds biases: the
    router's (a vector of n_experts) and each expert's (tuples of one vector per expert);
    Gemma 4 a scale on each expert's output, which multiplies its routing weight."""
    router: Any
    gate: Any
    up: Any
    down: Any
    shared_gate: Any = None
    shared_up: Any = None
    shared_down: Any = None
    shared_gate_inp: Any = None
    backend: Any = None   # the Backend holding them when not the layer's (its experts' home)
    router_bias: Any = None
    gate_bias: Any = None
    up_bias: Any = None
    down_bias: Any = None
    down_scale: Any = None   # float32 (n_experts,) on the host: each expert's output scale


@dataclass(frozen=True)
class DeltaNetSpec:
    """The shape of one Gated DeltaNet (linear attention) layer: key heads (q and k), value
    heads, the head size of both, the causal conv's kernel width, the L2 norm's epsilon."""
    n_k_heads: int
    n_v_heads: int
    head_dim: int
    conv_kernel: int
    eps: float

    @property
    def conv_channels(self) -> int:
        return (2 * self.n_k_heads + self.n_v_heads) * self.head_dim


@dataclass(frozen=True)
class DeltaNetWeights:
    """A DeltaNet layer's small tensors as float32 numpy on the host: the conv kernel
    (conv_channels, conv_kernel), the decay's bias and factor (n_v_heads,): A = -exp(A_log)."""
    conv: Any
    dt_bias: Any
    a: Any


@dataclass(frozen=True)
class KVLayout:
    """How one layer's KV pages are shaped: heads, head size, tokens per block, KV types."""
    n_kv_heads: int
    head_dim: int
    block_size: int
    k_type: str = "f16"
    v_type: str = "f16"


@dataclass
class KVBatch:
    """The KV side of a forward pass over a batch of tokens (from one or several sequences).

    For the model (as the runtime builds it), ``pages`` holds each layer's pages by layer
    index, ``tables`` one block table per KV cache group and ``layer_group`` each layer's
    group; ``layer()`` narrows it to what one layer's attention reads: that layer's pages (the
    backend's own object) and its group's table. A table is int32 (n_seqs, max_blocks), -1
    where a block is not held; ``row_seq`` is int32 (n,), each token's row in the tables.
    """
    pages: Any
    tables: Any
    row_seq: Any
    block_size: int
    layer_group: Sequence[int] = ()  # by layer index (the model's view; empty for one layer)
    # recurrent layers' states: the model's view, by layer index, a list with each batch
    # row's state (None for layers without); one layer's view: that list
    states: Sequence = ()

    def layer(self, index: int) -> "KVBatch":
        """What layer ``index`` reads and writes.

        Args:
            index: the layer's index into ``pages`` (and ``layer_group``).
        Returns:
            A KVBatch with that layer's pages and its group's block table.
        """
        return KVBatch(self.pages[index], self.tables[self.layer_group[index]], self.row_seq,
                       self.block_size, (), self.states[index] if self.states else ())


@dataclass(frozen=True)
class MemoryInfo:
    """The memory a backend allocates from: the pool's name (backends naming the same pool
    share its bytes, e.g. "host"), and its free and total bytes now."""
    pool: str
    free: int
    total: int


class Backend(Protocol):
    """Operations a model uses. ``x`` arrays are (n_tokens, features) unless noted."""

    name: str
    device: str          # where it computes, e.g. "cpu", "cuda:0"
    fused_blocks: bool   # decoder_block runs a whole block natively (else it is composed)
    copies_weights: bool  # uploads copy the file's bytes (its pages may then be dropped)
    recurrent: bool      # runs recurrent (linear attention) layers: delta_net and its states

    def begin_model(self, gguf_path: Any) -> None:
        """Called before a model's tensors are uploaded (e.g. to reuse stored conversions)."""

    def end_model(self) -> None:
        """Called after all tensors of the model are uploaded."""

    # ---- weights

    def upload_matrix(self, name: str, type_name: str, raw: Any, N: int, K: int,
                      done: Any = None) -> Any:
        """Keep a weight matrix (N out, K in) from GGUF bytes; quantized where possible.
        ``done(start, end)``, if given, may be called for byte ranges no longer needed."""

    def upload_experts(self, name: str, type_name: str, raw: Any, n_experts: int, N: int,
                       K: int, done: Any = None) -> Any:
        """Keep a stack of expert matrices (n_experts of (N out, K in), the GGUF 3-D tensor
        ``raw`` expert after expert), each computable on its own; ``done`` as for
        upload_matrix."""

    def upload_expert_halves(self, name: str, type_name: str, raw: Any, n_experts: int,
                             N: int, K: int, done: Any = None) -> tuple[Any, Any]:
        """Keep a fused stack (n_experts of (2N out, K in): each expert's first N rows, then
        its second N, as Gemma 4's ``ffn_gate_up_exps``) as two stacks of n_experts (N, K)
        for moe_ffn's gate and up; ``done`` as for upload_matrix."""

    def upload_vector(self, values: Any) -> Any:
        """Keep a float32 1-D tensor (norm weights, biases)."""

    def upload_embedding(self, type_name: str, rows: Any, dim: int) -> Any:
        """Keep a token embedding table (GGUF blocks, (vocab, row_bytes) uint8)."""

    def matrix_nbytes(self, w: Any) -> int:
        """Bytes an uploaded matrix (or stack of experts) occupies."""

    # ---- memory (the ledger plans with these before anything is allocated)

    def memory_info(self) -> MemoryInfo:
        """The pool this backend allocates from, and what is free in it now."""

    def plan_matrix_nbytes(self, type_name: str, N: int, K: int) -> int:
        """Bytes upload_matrix will take for a (N, K) matrix of this GGUF type."""

    def plan_experts_nbytes(self, type_name: str, n_experts: int, N: int,
                            K: int) -> tuple[int, int]:
        """(anonymous, file-backed) bytes upload_experts will take for a stack of n_experts
        (N, K) matrices: file-backed bytes are the mapped file's pages, read in place."""

    def plan_scratch_nbytes(self, largest: int) -> int:
        """Working bytes beyond activations, for matrices of at most ``largest`` elements."""

    def held_nbytes(self) -> int:
        """Bytes of weights and KV pages this backend holds now."""

    # ---- math

    def embed(self, table: Any, ids: Sequence[int], scale: float = 1.0) -> Any:
        """Rows of the token embedding for ``ids``, times ``scale``: (n, dim)."""

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """x / rms(x) * weight, per row."""

    def linear(self, x: Any, weights: Sequence[Any], biases: Sequence[Any] | None = None) -> list:
        """x @ W.T (+ b) for each W, sharing one preparation of x."""

    def head_norm(self, x: Any, n_heads: int, weight: Any, eps: float) -> Any:
        """RMSNorm of each head of x (n, n_heads * head_dim) with a per-head-dim weight."""

    def rope(self, x: Any, n_heads: int, positions: Sequence[int], spec: RopeSpec) -> Any:
        """Rotary position embedding of x (n, n_heads * head_dim)."""

    def attention(self, q: Any, k: Any, v: Any, kv: KVBatch, positions: Sequence[int],
                  n_heads: int, scale: float, window: int = 0,
                  k_balance: Sequence[float] | None = None, sinks: Any = None) -> Any:
        """Store k, v at ``positions`` of each token's sequence and attend causally:
        (n, n_heads * head_dim); ``kv`` is this layer's (``KVBatch.layer``). Keys of a
        rotated KV type are stored divided by ``k_balance`` (per dim, powers of two) and
        queries multiplied by it, before the rotation (kernels/kvpages.py key_balance).
        ``sinks``: None, or float32 numpy (n_heads,) logits that join each head's softmax
        denominator with no value (gpt-oss's attention sinks)."""

    def glu(self, gate: Any, up: Any, act: str) -> Any:
        """act(gate) * up with act in {'silu', 'gelu_tanh', 'sigmoid'}, or gpt-oss's
        'swiglu_oai': x sigmoid(1.702 x) (y + 1) with x = min(gate, 7), y = clamp(up, -7, 7)."""

    def layer_norm(self, x: Any, weight: Any, bias: Any, eps: float) -> Any:
        """(x - mean(x)) / sqrt(var(x) + eps) * weight (+ bias, unless None), per row."""

    def act(self, x: Any, act: str) -> Any:
        """act(x) elementwise with act in {'gelu_tanh', 'tanh'} (encoders' FFN and heads)."""

    def encoder_attention(self, q: Any, k: Any, v: Any, starts: Sequence[int], n_heads: int,
                          scale: float) -> Any:
        """Bidirectional attention with no KV cache: the tokens of sequence s are rows
        starts[s]..starts[s+1] and each attends to every token of its own sequence;
        k and v have n_kv heads of q's head size (GQA): (n, n_heads * head_dim)."""

    def add(self, x: Any, y: Any) -> Any:
        """x + y (may reuse x's storage)."""

    def moe_ffn(self, x: Any, w: MoEWeights, spec: MoESpec) -> Any:
        """A mixture-of-experts FFN of normed hidden states x (n, dim): each token's top-k
        experts (SwiGLU) weighted by the router, summed in rank order, plus the shared
        expert (times its sigmoid gate) where there is one: (n, dim). A token's result
        does not depend on the other tokens of x."""

    def decoder_block(self, x: Any, w: Any, spec: Any, positions: Sequence[int],
                      kv: KVBatch) -> Any:
        """One whole decoder block (models/block.py) in the backend's native way, with the
        bits of ``compose_block`` (a mixture of experts on this backend included); called
        only when ``fused_blocks``. Where the backend runs
        recurrent layers (``recurrent``), also Qwen3.5's blocks with a dense FFN: a Gated
        DeltaNet block (``spec.recurrent`` set, ``w`` a models/qwen35.py DeltaNetLayer) and
        a gated attention block (``w`` an AttnWeights), with the bits of that model's
        composed block."""

    def select_rows(self, x: Any, rows: Sequence[int]) -> Any:
        """The given rows of x."""

    def to_numpy(self, x: Any) -> Any:
        """A float32 numpy copy or view of x."""

    def from_numpy(self, x: Any) -> Any:
        """A float32 numpy array as this backend's array (activations entering its layers)."""

    def logsumexp(self, logits: Any) -> float:
        """log(sum(exp(logits))) of one float32 numpy row."""

    def delta_net(self, qkv: Any, alpha: Any, beta: Any, w: DeltaNetWeights,
                  spec: DeltaNetSpec, kv: KVBatch) -> Any:
        """A Gated DeltaNet mixer up to its output norm, each sequence's tokens in order:
        causal conv + SiLU of qkv (n, conv_channels) over the sequence's kept window, L2
        norms of the q and k heads, decays softplus(alpha + dt_bias) * a, strengths
        sigmoid(beta) (alpha, beta: (n, n_v_heads)), the gated delta rule over its state;
        ``kv.states`` holds each batch row's state (``new_recurrent_state``), updated.
        Returns (n, n_v_heads * head_dim)."""

    def new_recurrent_state(self, spec: DeltaNetSpec) -> Any:
        """One sequence's zeroed state of a recurrent layer (conv window and delta state)."""

    def copy_recurrent_state(self, state: Any) -> Any:
        """An independent copy of a recurrent state (forks, checkpoints)."""

    def recurrent_state_nbytes(self, spec: DeltaNetSpec) -> int:
        """Bytes one sequence's state of such a layer takes."""

    # ---- KV pages

    def kv_block_nbytes(self, layout: KVLayout) -> int:
        """Bytes one block of one layer takes, keys and values."""

    def new_kv_pages(self, layout: KVLayout, n_blocks: int) -> Any:
        """Pages for ``n_blocks`` blocks of one layer; memory is taken as blocks are written."""

    def copy_kv_block(self, pages: Any, src: int, dst: int) -> None:
        """Copy block ``src``'s keys and values to block ``dst`` (copy-on-write forks)."""
