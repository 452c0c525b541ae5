#!/usr/bin/env python3
"""What the MLX backend's conversion of formats it cannot hold exactly (Q6_K, Q3_K, Q2_K,
IQ4_NL, IQ4_XS) costs: the model is quantized to each format by llama.cpp (llama-cpp-python's
llama_model_quantize, every tensor in that format), then scored on the fixture passage by the
torch backend (exact dequantization, float32) and by the MLX backend at each bit width; the
KL divergence between the two is the conversion's (both compute in float32).

    python scripts/mlx_conversion_kl.py --llama-python /path/to/venv/bin/python
    python scripts/mlx_conversion_kl.py --types Q2_K --bits 4 6 8 --positions 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FTYPES = {"Q4_0": 2, "Q6_K": 18, "Q3_K": 11, "Q2_K": 10, "IQ4_NL": 25, "IQ4_XS": 30}
_QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = int(sys.argv[3]); p.allow_requantize = True; p.pure = True; p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def quantize(llama_python: str, src: Path, dst: Path, fmt: str) -> None:
    r = subprocess.run([llama_python, "-c", _QUANTIZE, str(src), str(dst), str(FTYPES[fmt])],
                       capture_output=True, text=True)
    if r.returncode != 0 or not dst.exists():
        sys.exit(f"quantizing to {fmt} failed: {r.stderr.strip().splitlines()[-1:]}")


def logits(path: Path, backend, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits with every tensor on one backend."""
    from localllm.formats.gguf import GGUFFile
    from localllm.models import build
    from localllm.models.common import Placement, WeightLoader
    from localllm.runtime.sequence import KVSpace, Runner, Sequence
    f = GGUFFile(path)
    meta = f.metadata
    from localllm.models import module_for
    args = module_for(meta).ModelArgs.from_gguf(meta, meta["general.architecture"])
    net = build(meta, WeightLoader(f, Placement.single(backend, args.n_layers)), args)
    space = KVSpace(net, "f16", "f16", 16, len(ids) + 16, b"kl")
    runner = Runner(net, space, len(ids) + 16, 256, args.vocab_size)
    with Sequence(runner) as seq:
        return seq.feed(ids, all_logits=True)


def kl_top1(p_logits: np.ndarray, q_logits: np.ndarray) -> tuple[float, float]:
    def ls(z):
        z = z.astype(np.float64)
        z -= z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    a, b = ls(p_logits), ls(q_logits)
    return float((np.exp(a) * (a - b)).sum(-1).mean()), float((a.argmax(1) == b.argmax(1)).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--llama-python", required=True,
                    help="a Python with llama-cpp-python, which quantizes the model")
    ap.add_argument("--types", nargs="+", default=["Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])
    ap.add_argument("--bits", nargs="+", type=int, default=None,
                    help="MLX bit widths to try (default: the backend's choice only)")
    ap.add_argument("--positions", type=int, default=200, help="passage tokens scored")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import localllm
    localllm.configure_process()  # before the model runs any kernel
    from localllm.backends import mlx_quant
    from localllm.backends.mlx import MlxBackend
    from localllm.backends.torch import TorchBackend
    from localllm.formats.fetch import resolve_model_path
    src = resolve_model_path(args.model)
    fx = json.loads((ROOT / "tests/fixtures/logits/smollm_logits.json").read_text())
    ids = fx["ids"][:args.positions]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ["Q4_0"] + list(args.types):  # Q4_0: an exact format, the baseline
            dst = Path(tmp) / f"{fmt}.gguf"
            quantize(args.llama_python, src, dst, fmt)
            exact = logits(dst, TorchBackend(device="cpu"), ids)
            widths = args.bits or [mlx_quant.CONVERT_BITS.get(fmt, 0)]
            for bits in widths:
                t0 = time.perf_counter()
                conv = dict(mlx_quant.CONVERT_BITS)
                if fmt in conv:
                    conv[fmt] = bits
                got = logits(dst, MlxBackend(convert_bits=conv), ids)
                kl, top1 = kl_top1(exact, got)
                bpw = mlx_quant.packed_nbytes(fmt, 1, 4096, conv) * 8 / 4096
                rows.append({"format": fmt, "mlx_bits": bits if fmt in conv else "exact",
                             "mlx_bits_per_weight": bpw, "kl_mean": kl, "top1": top1,
                             "positions": len(ids), "seconds": time.perf_counter() - t0})
                r = rows[-1]
                print(f"{fmt:7s} MLX {str(r['mlx_bits']):>5s} ({bpw:.1f} bpw): KL {kl:.6f} "
                      f"nats, top-1 {top1:.4f} vs exact dequantization, {len(ids)} positions",
                      file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
