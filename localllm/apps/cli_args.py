"""The `llm` command line: its parser, and the settings read from the parsed options (the
load settings every model-loading command shares, speculation, sampling)."""

from __future__ import annotations

import argparse
import sys

from localllm.apps.cli_embed import add_embed_parser
from localllm.errors import BadSetting

EXIT_USAGE = 2       # a command line or a setting that makes no sense


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage dump
        sys.stderr.write(f"error: {message} (see `{self.prog} --help`)\n")
        sys.exit(EXIT_USAGE)


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=0,
                   help="context size in tokens (default: min(4096, the model's))")
    p.add_argument("-t", "--threads", type=int, default=0,
                   help="CPU threads (default: physical cores)")
    p.add_argument("-b", "--batch-size", type=_positive_int, default=256,
                   help="prompt tokens per forward pass (default 256)")
    p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="chat template: a builtin name or a Jinja file")
    p.add_argument("--models-dir", default=None, help="model cache directory")
    p.add_argument("--weight-cache", action=argparse.BooleanOptionalAction, default=False,
                   help="keep the repacked weights on disk, a second copy of the model's size "
                        "read back on later loads (default: repack on every load)")
    kv = "KV cache type: f16 (default), bf16, q8_0, q4_0 or fp8"
    p.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE", help=kv + " (keys)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE", help=kv + " (values)")
    p.add_argument("--kv-block-size", type=_positive_int, default=16,
                   help="tokens per KV block, a multiple of 16 (default 16)")
    p.add_argument("--kv-pool-mb", type=float, default=0,
                   help="KV cache limit in MB (default: two contexts, as memory allows)")
    _add_split_options(p)


def _add_split_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "torch", "mlx"),
                   help="GPU backend: torch (CUDA, or its CPU build), mlx (Metal, or its CPU "
                        "build) or cpu (none); default: CUDA torch if present, else MLX on "
                        "Apple Silicon, else cpu")
    p.add_argument("-ngl", "--gpu-layers", default="auto", metavar="N|auto|all",
                   help="layers on the GPU backend, the last ones, with the output head "
                        "(default auto: as many as fit its free memory)")
    p.add_argument("--cpu-moe", action="store_true",
                   help="keep every layer's experts (ffn_*_exps) on the CPU")
    p.add_argument("--n-cpu-moe", type=int, default=0, metavar="N",
                   help="keep the experts of the first N layers on the CPU")
    p.add_argument("--expert-cache-mb", type=float, default=None, metavar="MB",
                   help="packed copies of the experts read from the file, most recently used "
                        "kept, up to MB (0: none, every use reads the file's layout; default: "
                        "half the memory free beyond 1 GiB, at most all the experts)")
    p.add_argument("-ot", "--override-tensor", action="append", default=[],
                   metavar="REGEX=BACKEND",
                   help="put tensors whose name matches REGEX on BACKEND (CPU or GPU), "
                        "repeatable or comma-separated, as llama.cpp's")


def model_settings(args) -> dict:
    """LoadSettings fields from the model options (shared by every command that loads)."""
    if args.ctx_size < 0:
        raise BadSetting(f"--ctx-size must be >= 0, got {args.ctx_size}", param="ctx_size")
    if args.threads < 0:
        raise BadSetting(f"--threads must be >= 0, got {args.threads}", param="threads")
    if args.kv_pool_mb < 0:
        raise BadSetting(f"--kv-pool-mb must be >= 0, got {args.kv_pool_mb:g}",
                         param="kv_pool_mb")
    return dict(ctx_size=args.ctx_size, threads=args.threads, batch_size=args.batch_size,
                chat_template=args.chat_template, models_dir=args.models_dir,
                weight_cache=args.weight_cache, ctk=args.cache_type_k,
                ctv=args.cache_type_v, kv_block_size=args.kv_block_size,
                kv_pool_mb=args.kv_pool_mb, **split_settings(args))


def split_settings(args) -> dict:
    """LoadSettings fields of the CPU/GPU split options."""
    if args.expert_cache_mb is not None and not args.expert_cache_mb >= 0:
        raise BadSetting(f"--expert-cache-mb must be >= 0, got {args.expert_cache_mb:g}",
                         param="expert_cache_mb")
    return dict(backend=args.backend, gpu_layers=gpu_layers_option(args.gpu_layers),
                cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe,
                expert_cache_mb=args.expert_cache_mb,
                override_tensor=tuple(args.override_tensor))


def gpu_layers_option(text: str) -> int | str:
    from localllm.runtime.placement import parse_gpu_layers
    return parse_gpu_layers(text)


LOOKUP_DEFAULT = 10


def _add_speculative_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (the output stays exactly the same)")
    g.add_argument("--lookup", type=int, default=LOOKUP_DEFAULT, metavar="N",
                   help="prompt lookup: draft up to N tokens by matching the last tokens "
                        f"against the prompt and the text so far (default {LOOKUP_DEFAULT})")
    g.add_argument("--no-lookup", action="store_true", help="no prompt lookup")
    g.add_argument("--draft", default=None, metavar="MODEL",
                   help="a draft model (GGUF path or known name) with the same vocabulary")
    g.add_argument("--draft-max", type=int, default=8, metavar="K",
                   help="most tokens the draft model drafts per step (default 8)")


def speculative_settings(args) -> dict:
    """LoadSettings fields for speculation (run, chat and serve: lookup on by default)."""
    from localllm.generation.speculative import MAX_DRAFT
    if not 1 <= args.lookup <= MAX_DRAFT:
        raise BadSetting(f"--lookup must be in 1..{MAX_DRAFT}, got {args.lookup}",
                         param="lookup")
    if not 1 <= args.draft_max <= MAX_DRAFT:
        raise BadSetting(f"--draft-max must be in 1..{MAX_DRAFT}, got {args.draft_max}",
                         param="draft_max")
    return dict(lookup=0 if args.no_lookup else args.lookup, draft=args.draft,
                draft_max=args.draft_max)


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate (-1: until end of text or context)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end of text")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="llm", description="Run GGUF language models locally.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="generate from one prompt and exit")
    run.add_argument("model", nargs="?", default=None,
                     help="GGUF path or known model name (default: smollm2-135m)")
    src = run.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the prompt ('-' reads standard input)")
    src.add_argument("-f", "--file", help="read the prompt from a file")
    run.add_argument("-sys", "--system", default=None, help="system message (chat models)")
    run.add_argument("--raw", action="store_true",
                     help="no chat template: continue the text (the default for models whose "
                          "file has no chat template, unless --chat-template or --system)")
    run.add_argument("-v", "--verbose", action="store_true", help="statistics on stderr")
    run.add_argument("--hide-reasoning", action="store_true",
                     help="do not show a reasoning model's thinking (shown dimmed on stderr)")
    run.add_argument("--context-shift", action="store_true",
                     help="when the chat does not fit, drop its oldest turns (said on stderr)")
    out = run.add_mutually_exclusive_group()
    out.add_argument("--grammar", default=None, metavar="FILE|TEXT",
                     help="constrain the output to a GBNF grammar (a file, or the text itself)")
    out.add_argument("--grammar-file", default=None, metavar="FILE",
                     help="constrain the output to the GBNF grammar in FILE")
    out.add_argument("-j", "--json-schema", default=None, metavar="FILE|TEXT",
                     help="constrain the output to JSON valid under a schema (a file, or "
                          "the schema's JSON text)")
    run.add_argument("--fim-prefix", default=None, metavar="TEXT",
                     help="fill in the middle after this text (the prompt, if any, starts the "
                          "middle; needs a model with FIM tokens)")
    run.add_argument("--fim-suffix", default=None, metavar="TEXT",
                     help="... and before this text")
    _add_model_options(run)
    _add_speculative_options(run)
    _add_sampling_options(run)
    add_embed_parser(sub, _add_model_options)

    ppl = sub.add_parser("perplexity", help="perplexity of a text, as llama.cpp measures it")
    ppl.add_argument("model", nargs="?", default=None, help="GGUF path or known model name")
    ppl.add_argument("-f", "--file", required=True, help="the text to score")
    ppl.add_argument("--kv-compare", default=None, metavar="TYPE",
                     help="also score with this KV type (keys and values) against f16")
    ppl.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_model_options(ppl)

    _add_serve_parser(sub)

    chat = sub.add_parser("chat", help="a terminal chat with branching history")
    chat.add_argument("model", nargs="?", default=None,
                      help="GGUF path or known model name (default: smollm2-135m, or the "
                           "resumed conversation's)")
    chat.add_argument("-sys", "--system", default=None, help="system prompt")
    which = chat.add_mutually_exclusive_group()
    which.add_argument("--list", action="store_true", help="list saved conversations and exit")
    which.add_argument("--resume", nargs="?", const="latest", default=None, metavar="ID",
                       help="reopen a saved conversation (default: the latest)")
    _add_model_options(chat)
    _add_speculative_options(chat)
    _add_sampling_options(chat)

    pull = sub.add_parser("pull", help="download a known model into the cache")
    pull.add_argument("name")
    pull.add_argument("--models-dir", default=None)

    ls = sub.add_parser("list", help="models in the cache")
    ls.add_argument("--models-dir", default=None)

    insp = sub.add_parser("inspect", help="metadata, tensors and memory of a model")
    insp.add_argument("model")
    insp.add_argument("--models-dir", default=None)
    insp.add_argument("--all", action="store_true", help="print every metadata key in full")
    insp.add_argument("--plan", action="store_true",
                      help="print the memory plan per device (weights, KV, scratch) instead")
    insp.add_argument("-c", "--ctx-size", type=int, default=0,
                      help="context size the plan is for (default: min(4096, the model's))")
    kv = "KV cache type the plan is for (default f16)"
    insp.add_argument("-ctk", "--cache-type-k", default="f16", metavar="TYPE", help=kv)
    insp.add_argument("-ctv", "--cache-type-v", default="f16", metavar="TYPE", help=kv)
    insp.add_argument("-b", "--batch-size", type=_positive_int, default=256,
                      help="prompt tokens per forward pass (default 256)")
    _add_split_options(insp)
    return ap


def _add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="a local OpenAI-compatible endpoint")
    srv.add_argument("model", nargs="?", default=None,
                     help="GGUF path or known model name (default: smollm2-135m)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1; others need an API key)")
    srv.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free)")
    key = srv.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="bearer token clients must send")
    key.add_argument("--api-key-file", default=None, help="read the API key from a file")
    srv.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                     help="Host header to accept besides loopback names (repeatable; '*': any)")
    srv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="browser origin allowed to call the API (repeatable; default: none)")
    srv.add_argument("--parallel", type=_positive_int, default=None,
                     help="requests generated together in each forward pass (default 4, "
                          "fewer if the KV cache cannot hold a full context for each)")
    srv.add_argument("--max-queue", type=int, default=16,
                     help="requests waiting beyond --parallel; past that 503 (default 16)")
    srv.add_argument("--max-body", type=_positive_int, default=4 << 20, metavar="BYTES",
                     help="largest request body (default 4 MiB)")
    srv.add_argument("--max-connections", type=_positive_int, default=256, metavar="N",
                     help="open connections at most; past that 503 (default 256)")
    srv.add_argument("--request-timeout", type=float, default=10.0, metavar="SECONDS",
                     help="time a client has to send a request's head, and at most between "
                          "parts of its body (default 10)")
    srv.add_argument("--alias", action="append", default=[], metavar="NAME",
                     help="another name /v1/models lists for the model (repeatable)")
    srv.add_argument("--strict-model", action="store_true",
                     help="refuse (404) requests naming another model; by default any name "
                          "is served by the one model")
    srv.add_argument("--reasoning-format", default="auto", choices=("none", "deepseek", "auto"),
                     help="none: a model's reasoning stays in the content; deepseek, auto: "
                          "it comes apart, as reasoning_content (default auto)")
    srv.add_argument("-v", "--verbose", action="store_true", help="log every request")
    _add_model_options(srv)
    _add_speculative_options(srv)
    _add_sampling_options(srv)


def sampling_settings(args) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos,
                max_tokens=args.n_predict if args.n_predict >= 0 else 1 << 62)
