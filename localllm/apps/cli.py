"""The `llm` command: run a prompt, chat, serve a model, pull, list and inspect models.

Stdout carries only generated text; messages and statistics go to stderr. Every failure is
one line starting with ``error:`` and a non-zero exit code, by its class (see EXITS).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from localllm.apps.cli_args import (EXIT_USAGE, build_parser, model_settings,
                                    sampling_settings, speculative_settings, split_settings)
from localllm.apps.cli_embed import cmd_embed
from localllm.errors import (BadSetting, ContextFull, FetchError, KVPoolFull, LocalLLMError,
                             ModelFileError, NotEnoughMemory, TokenOutOfVocab)
from localllm.text.reasoning import Part, ReasoningSplitter, style_of_template
from .run_output import CompileLine, ReasoningOut, write_parts

EXIT_ERROR = 1       # anything else that went wrong (a file that cannot be read, ...)
EXIT_MODEL = 3       # a model file that cannot be read or run
EXIT_INPUT = 4       # a prompt that does not fit the context, or token ids outside the vocabulary
EXIT_MEMORY = 5      # the model or its KV cache does not fit the memory there is
EXIT_FETCH = 6       # a model could not be downloaded
EXIT_INTERRUPTED = 130


# ----------------------------------------------------------------------------- run

def _read_prompt(args) -> str:
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    if args.prompt == "-" or (args.prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if args.prompt is None:
        raise ValueError("no prompt: give -p PROMPT, -f FILE, or pipe text on standard input")
    return args.prompt


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (VmHWM on Linux: unlike ru_maxrss it is
    not inherited across exec from the parent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def _configure(threads: int) -> None:
    """Set the process up for the kernels (threads, allocator, kernel cache) before anything
    runs them; 0 threads: the physical cores, as ``load`` takes it."""
    from localllm.api import configure_process, physical_cores
    configure_process(threads=threads or physical_cores())


def _file_or_text(value: str) -> str:
    """The contents of the file ``value`` names, or ``value`` itself when no such file."""
    return Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value


def _run_constraint(args, model):
    """The TokenConstraint --grammar, --grammar-file or --json-schema asks for (or None).

    Raises:
        GrammarError: the grammar or schema is bad or unsupported (the message says where).
    """
    from localllm.generation.constrain import GrammarError, TokenConstraint
    if args.grammar_file is not None:
        return TokenConstraint.gbnf(Path(args.grammar_file).read_text(encoding="utf-8"),
                                    model.token_vocab)
    if args.grammar is not None:
        return TokenConstraint.gbnf(_file_or_text(args.grammar), model.token_vocab)
    if args.json_schema is not None:
        try:
            schema = json.loads(_file_or_text(args.json_schema))
        except json.JSONDecodeError as e:
            raise GrammarError(f"--json-schema is neither a file nor JSON: {e}") from None
        return TokenConstraint.json_schema(schema, model.token_vocab)
    return None


def cmd_run(args) -> int:
    from localllm.api import load
    fim = args.fim_prefix is not None or args.fim_suffix is not None
    prompt = _read_prompt(args) if not fim or args.prompt or args.file else ""
    sampling = sampling_settings(args)
    from localllm.generation.sampling import SamplingParams
    SamplingParams(**sampling).validate()
    settings = model_settings(args) | speculative_settings(args)
    _configure(settings["threads"])
    t0 = time.perf_counter()
    constrained = any(v is not None for v in (args.grammar, args.grammar_file, args.json_schema))
    model = load(args.model, **settings, compile_progress=CompileLine(),
                 prime_grammar=constrained)   # its kernels compile with the model's
    load_s = time.perf_counter() - t0
    # A file without a chat template is a base model: continue the text, as llama.cpp's CLI,
    # Ollama and mlx-lm do, unless a template or a system prompt asks for chat turns.
    chat = not args.raw and (model.template.from_file or args.chat_template is not None
                             or args.system is not None)
    constraint = _run_constraint(args, model)
    if constraint is not None:
        sampling["constraint"] = constraint
    if fim:
        stream = model.generate(model.infill_tokens(args.fim_prefix or "", args.fim_suffix or "",
                                                    prompt=prompt), **sampling)
    elif not chat:
        stream = model.generate(prompt, **sampling)
    else:
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": prompt})
        stream = model.chat(messages, context_shift=args.context_shift, **sampling)
    out = sys.stdout
    shown = ReasoningOut(sys.stderr, args.hide_reasoning)
    splitter = None
    if chat and not fim:  # reasoning (<think>, harmony analysis) to stderr, the answer to stdout
        splitter = ReasoningSplitter(style_of_template(model.template.source),
                                     model.render_chat(messages))
    dropped = 0
    for piece in stream:
        if stream.stats.dropped_messages > dropped:
            dropped = stream.stats.dropped_messages
            print(f"context shift: dropped the {dropped} oldest message(s) to fit the "
                  f"{model.ctx}-token context", file=sys.stderr)
        write_parts(splitter.feed(piece) if splitter else [Part("content", piece)], out, shown)
    if splitter is not None:
        write_parts(splitter.finish(), out, shown)
    shown.end()
    out.write("\n")
    out.flush()
    if args.verbose:
        s, kv = stream.stats, model.kv_stats()
        mb = 1 << 20
        print(model.plan.format(), file=sys.stderr)
        print(f"load: {load_s:.2f} s ({model.path.name}, {model.plan.summary()}, ctx {model.ctx})\n"
              f"prompt: {s.prompt_tokens} tokens in {s.prompt_seconds:.3f} s "
              f"({s.prompt_tps:.1f} tok/s), {s.cached_tokens} cached\n"
              f"generated: {s.generated_tokens} tokens in {s.generate_seconds:.3f} s "
              f"({s.generate_tps:.1f} tok/s), finish: {s.finish_reason}\n"
              f"time to first token: {s.time_to_first_token:.3f} s\n"
              f"{_speculation_line(s, model)}"
              f"seed: {s.seed}\n"
              f"kv cache: {kv.k_type}/{kv.v_type}, {kv.bytes_per_token} bytes per token, "
              f"blocks of {kv.block_size}: {kv.blocks_used} used, {kv.blocks_cached} cached, "
              f"{kv.blocks_free} free of {kv.blocks_total} "
              f"({kv.blocks_total * kv.block_size * kv.bytes_per_token / mb:.0f} MB limit)\n"
              f"{_recurrent_line(kv)}"
              f"peak memory: {peak_rss_mb():.0f} MB", file=sys.stderr)
    return 0


def _recurrent_line(kv) -> str:
    """The -v line on recurrent layers' states (models with linear attention)."""
    if not (kv.recurrent_bytes or kv.checkpoint_bytes):
        return ""
    mb = 1 << 20
    return (f"recurrent state: {kv.recurrent_bytes / mb:.1f} MB held by sequences, "
            f"{kv.checkpoint_bytes / mb:.1f} MB in checkpoints\n")


def _speculation_line(s, model) -> str:
    """The -v line on drafts: acceptance, tokens per model pass, measured speedup."""
    kinds = ["prompt lookup"] if model.settings.lookup else []
    if model.draft is not None:
        kinds.append(f"draft {model.draft.path.name}")
    if not kinds:
        return "speculation: off\n"
    speed = f"{s.speedup:.2f}x" if s.speedup else "n/a"
    return (f"speculation ({', '.join(kinds)}): {s.accepted_tokens}/{s.draft_tokens} drafted "
            f"tokens accepted ({100 * s.acceptance_rate:.0f}%), {s.tokens_per_pass:.2f} tokens "
            f"per pass over {s.decode_passes} passes, speedup {speed} over plain decoding\n")


def cmd_perplexity(args) -> int:
    from localllm.api import load
    from localllm.generation.perplexity import perplexity
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    settings = model_settings(args)
    if not args.ctx_size:
        settings["ctx_size"] = 512  # llama.cpp's perplexity default
    _configure(settings["threads"])
    model = load(args.model, **settings)
    compare = [model.with_kv(args.kv_compare, args.kv_compare)] if args.kv_compare else []
    if compare and (model.kv.k_type, model.kv.v_type) != ("f16", "f16"):
        raise ValueError("--kv-compare compares against f16: leave -ctk/-ctv at f16")
    ids = model.tokenize(text)
    print(f"{model.path.name}: {len(ids)} tokens, {len(ids) // model.ctx} windows of "
          f"{model.ctx}, KV {model.kv.k_type}/{model.kv.v_type}"
          + (f", compared with {args.kv_compare}" if compare else ""), file=sys.stderr)

    def progress(done, total, tps, ppl):
        print(f"\r[{done}/{total}] {tps:.0f} tok/s, PPL so far {ppl:.4f}", end="",
              file=sys.stderr, flush=True)
    r = perplexity(model, ids, model.ctx, compare, progress)
    print(file=sys.stderr)
    if args.json:
        import json
        print(json.dumps(r, indent=2))
        return 0
    print(f"Final estimate: PPL = {r['ppl']:.4f} +/- {r['ppl_err']:.5f} "
          f"({r['tokens_scored']} tokens in {r['windows']} windows, {r['seconds']:.1f} s)")
    for c in r["compare"]:
        print(f"KV {c['kv_type']}: PPL = {c['ppl']:.4f} +/- {c['ppl_err']:.5f}, "
              f"dPPL = {c['delta_ppl']:+.4f} ({100 * math.expm1(c['ln_ppl_ratio']):+.2f}% "
              f"+/- {100 * c['ln_ppl_ratio_err']:.2f}%), mean KL = {c['mean_kl']:.6f} "
              f"+/- {c['mean_kl_err']:.6f}, top-1 agreement {100 * c['top1_agreement']:.2f}%")
    return 0


def cmd_serve(args) -> int:
    try:
        from .server import ServerSettings, serve
        from localllm.apps.server.settings import read_api_key
    except ImportError as e:
        raise ValueError(f"llm serve needs the server extra ({e.name} is missing): "
                         "pip install 'localllm[server]'") from None
    from localllm.generation.sampling import SamplingParams
    sampling = sampling_settings(args)
    SamplingParams(**sampling).validate()
    key = read_api_key(args.api_key_file) if args.api_key_file else args.api_key
    loading = model_settings(args) | speculative_settings(args)
    _configure(loading["threads"])
    return serve(ServerSettings(
        model=args.model, host=args.host, port=args.port, api_key=key,
        allow_hosts=args.allow_host, cors_origins=args.cors_origin,
        parallel=args.parallel or 4, parallel_default=args.parallel is None,
        max_queue=args.max_queue, max_body=args.max_body,
        max_connections=args.max_connections, request_timeout=args.request_timeout,
        load=loading, sampling=sampling, reasoning_format=args.reasoning_format,
        verbose=args.verbose, aliases=args.alias, strict_model=args.strict_model))


# ----------------------------------------------------------------------------- chat

def cmd_chat(args) -> int:
    try:
        from localllm.apps.tui.chat_cli import list_conversations, run_chat
    except ImportError as e:
        raise ValueError(f"llm chat needs textual ({e.name} is not installed): "
                         "pip install 'localllm[chat]'") from None
    if args.list:
        return list_conversations()
    sampling = sampling_settings(args)
    from localllm.generation.sampling import SamplingParams
    SamplingParams(**sampling).validate()
    if args.n_predict < 0:
        sampling["max_tokens"] = -1   # until end of text or a full context
    settings = model_settings(args) | speculative_settings(args)
    _configure(settings["threads"])
    return run_chat(args.model, settings, sampling, args.system, args.resume)


# ----------------------------------------------------------------------------- pull / list / inspect

def cmd_pull(args) -> int:
    from localllm.api import load
    from localllm.formats.fetch import fetch
    path = fetch(args.name, args.models_dir)
    # Build its kernels now, so that its first run starts at once.
    _configure(0)
    load(path, models_dir=args.models_dir, compile_progress=CompileLine()).close()
    print(path)
    return 0


def _describe(path) -> dict:
    from localllm.formats.gguf import GGUFFile
    from localllm.formats.inspect import describe
    with GGUFFile(path) as f:
        return describe(f)


def cmd_list(args) -> int:
    from localllm.formats.fetch import KNOWN_MODELS, cache_dir, list_cached
    files = list_cached(args.models_dir)
    if not files:
        print(f"no models in {cache_dir(args.models_dir)}; try `llm pull {next(iter(KNOWN_MODELS))}`",
              file=sys.stderr)
        return 0
    names = {m.filename: m.name for m in KNOWN_MODELS.values()}
    rows = [("NAME", "SIZE", "ARCH", "QUANT", "FILE")]
    for p in files:
        try:
            d = _describe(p)
            arch, quant = d["architecture"], d["quant"]
        except Exception as e:  # a broken file in the cache is listed, not fatal
            arch, quant = "?", f"unreadable: {e}"
        rows.append((names.get(p.name, p.stem), f"{p.stat().st_size / 1e6:.0f} MB", arch, quant, str(p)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0


def cmd_inspect(args) -> int:
    from localllm.formats.fetch import resolve_model_path
    from localllm.formats.inspect import format_description
    path = resolve_model_path(args.model, args.models_dir, download=False)
    if args.plan:
        from localllm.api import LoadSettings, plan_model
        from localllm.formats.gguf import GGUFFile
        if args.ctx_size < 0:
            raise ValueError(f"--ctx-size must be >= 0, got {args.ctx_size}")
        settings = LoadSettings(ctx_size=args.ctx_size, batch_size=args.batch_size,
                                ctk=args.cache_type_k, ctv=args.cache_type_v,
                                models_dir=args.models_dir, **split_settings(args))
        _configure(0)  # the plan packs a tile of each format to measure it
        with GGUFFile(path) as f:
            print(f"{path.name}:\n{plan_model(f, settings).memory.format()}")
        return 0
    print(format_description(path, _describe(path), show_all=args.all))
    return 0


# ----------------------------------------------------------------------------- main

def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _no_such_file(e: BaseException) -> str:
    return f"no such file: {e.filename}" if getattr(e, "filename", None) else _first_line(e)


@dataclass(frozen=True)
class Exit:
    """How the command ends on one class of error."""
    code: int
    message: Callable[[BaseException], str] = _first_line   # the line after "error: "


# Error class -> exit code and message. An error takes the row of the nearest class in its
# method resolution order; a class in no row is a bug, and its traceback shows.
EXITS: dict[type[BaseException], Exit] = {
    BadSetting: Exit(EXIT_USAGE),
    ModelFileError: Exit(EXIT_MODEL),         # GGUFError, UnsupportedModel
    ContextFull: Exit(EXIT_INPUT),            # PromptTooLong
    TokenOutOfVocab: Exit(EXIT_INPUT),
    NotEnoughMemory: Exit(EXIT_MEMORY),
    KVPoolFull: Exit(EXIT_MEMORY),
    MemoryError: Exit(EXIT_MEMORY),
    FetchError: Exit(EXIT_FETCH),
    LocalLLMError: Exit(EXIT_ERROR),          # TokenizerError, TemplateError, the rest
    FileNotFoundError: Exit(EXIT_ERROR, _no_such_file),
    OSError: Exit(EXIT_ERROR),
    ValueError: Exit(EXIT_ERROR),
    KeyError: Exit(EXIT_ERROR),
    TypeError: Exit(EXIT_ERROR),
}


def exit_for(e: BaseException) -> Exit | None:
    """The EXITS row of an error, or None for one the command does not expect."""
    return next((EXITS[c] for c in type(e).__mro__ if c in EXITS), None)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    handler = {"run": cmd_run, "chat": cmd_chat, "serve": cmd_serve,
               "perplexity": cmd_perplexity, "pull": cmd_pull, "list": cmd_list,
               "inspect": cmd_inspect,
               "embed": lambda a: cmd_embed(a, model_settings(a))}[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`); nothing more to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        row = exit_for(e)
        if row is None:
            raise
        sys.stderr.write(f"error: {row.message(e)}\n")
        return row.code


if __name__ == "__main__":
    sys.exit(main())
