"""Fill-in-the-middle prompts from a model's FIM tokens (tokenizer.ggml.fim_*_token_id), in
llama-server's order: the repo-level context of extra files first, then prefix, suffix and
middle (PSM, or SPM on request), each part cut to fit a batch as llama-server cuts it.

    [FIM_REP]myproject\\n [FIM_SEP]name0\\n text0 ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from localllm.errors import UnsupportedModel

# llama-server's defaults for the cuts (its --batch-size)
N_BATCH = 2048
# Between extra chunks when the model has no file separator: "\n\n--- snippet ---\n\n"
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class ExtraFile:
    """A file of repo-level context: its name and text."""
    filename: str
    text: str


def fim_ids(tok) -> tuple[int, int, int]:
    """The model's prefix, suffix and middle tokens.

    Raises:
        UnsupportedModel: one of them is missing (naming which).
    """
    names = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
    missing = [what for key, what in names.items() if tok.special_id(key) is None]
    if missing:
        raise UnsupportedModel("infill is not supported by this model: it has no fill-in-the-"
                               f"middle {', '.join(missing)} token", param="model")
    return tok.special_id("fim_pre"), tok.special_id("fim_suf"), tok.special_id("fim_mid")


def _mixed(tok, part: str | Sequence[str | int]) -> list[int]:
    """A text, or a list of texts and token ids, as tokens (no special tokens parsed)."""
    if isinstance(part, str):
        return tok.encode(part, add_special=False)
    out: list[int] = []
    for p in part:
        out += tok.encode(p, add_special=False) if isinstance(p, str) else [int(p)]
    return out


def infill_tokens(tok, prefix: str | Sequence[str | int], suffix: str | Sequence[str | int],
                  extra: Sequence[ExtraFile] = (), prompt: str = "", n_ctx: int = 4096,
                  n_predict: int = -1, n_batch: int = N_BATCH, spm: bool = False) -> list[int]:
    """The token ids llama-server's /infill runs for these fields.

    Args:
        tok: the model's Tokenizer; prefix, suffix: the text around the hole (or mixed
            lists of texts and ids); extra: files of context; prompt: text that starts the
            middle (special tokens parsed); n_ctx: the context size; n_predict: tokens to
            generate (-1: unbounded), which leaves room for them in the context;
            n_batch: the batch size the prefix and suffix are cut to; spm: suffix first.
    Returns:
        The prompt's token ids.
    Raises:
        UnsupportedModel: the model has no FIM prefix, suffix or middle token.
    """
    pre, suf, mid = fim_ids(tok)
    rep, sep = tok.special_id("fim_rep"), tok.special_id("fim_sep")
    extra_ids: list[int] = []
    if rep is not None:
        extra_ids += [rep] + tok.encode("myproject\n", add_special=False)
    for chunk in extra:
        if sep is not None:
            extra_ids += [sep] + tok.encode(chunk.filename + "\n", add_special=False)
        else:
            extra_ids += tok.encode(CHUNK_SEPARATOR, add_special=False)
        extra_ids += tok.encode(chunk.text, add_special=False)
    if sep is not None:
        extra_ids += [sep] + tok.encode("filename\n", add_special=False)
    prompt_ids = tok.encode(prompt, add_special=False, parse_special=True) if prompt else []
    prefix_ids, suffix_ids = _mixed(tok, prefix), _mixed(tok, suffix)
    # prefix : suffix = 3 : 1 of a batch; the extra context fills what the reply leaves
    n_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    prefix_part = [pre] + prefix_ids[len(prefix_ids) - n_prefix:] + prompt_ids
    suffix_part = [suf] + suffix_ids[:n_suffix]
    first, second = (suffix_part, prefix_part) if spm else (prefix_part, suffix_part)
    if tok.add_bos and tok.bos_id is not None:
        first = [tok.bos_id] + first
    return extra_ids[len(extra_ids) - n_extra:] + first + second + [mid]
