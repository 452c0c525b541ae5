"""What a loaded Model offers beyond generation: embeddings (pooled final hidden states,
batched across inputs), reranking by a classification head, and fill-in-the-middle prompts
in llama-server's order. localllm.api.Model mixes it in."""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

from localllm.errors import UnsupportedModel
from localllm.generation.embedding import EmbeddingRun, check_pooling
from localllm.models.common import pooling_type
from localllm.runtime.sequence import check_tokens
from localllm.text.fim import ExtraFile, infill_tokens


class EmbeddingMixin:
    """Model's embedding, ranking and infill methods (they read the Model's tokenizer,
    metadata, net, runner and settings)."""

    @property
    def pooling(self) -> str:
        """How embed() pools by default: the file's {arch}.pooling_type, else mean for an
        encoder and last for a decoder (whose last token has seen the whole input)."""
        p = pooling_type(self.metadata, self.args.arch)
        if p == "none":
            return "last" if self.net.generates else "mean"
        return p

    def embed(self, inputs: Seq[str] | Seq[Seq[int]], pooling: str | None = None,
              normalize: bool = True, add_special: bool = True) -> list[np.ndarray]:
        """Embedding vectors of texts (or token id lists), batched across inputs into
        forward passes of up to ``batch_size`` tokens (an input's vector is the same
        whatever it is batched with).

        Args:
            inputs: texts, or token id lists (a single text: a list of one).
            pooling: none, mean, cls, last or rank; None: ``self.pooling``.
            normalize: L2-normalise each vector (llama.cpp's default); rank scores never.
            add_special: add BOS/EOS to texts as the tokenizer says.
        Returns:
            Per input: float32 (dim,); (n_tokens, dim) for "none"; rank scores for "rank".
        Raises:
            BadSetting: an unknown pooling; EmptyPrompt, PromptTooLong, TokenOutOfVocab:
            an input without tokens, beyond the context, or with unknown ids.
        """
        run = self.start_embed(inputs, pooling, normalize, add_special)
        while not run.done:
            run.step()
        return run.vectors

    def start_embed(self, inputs: Seq[str] | Seq[Seq[int]], pooling: str | None = None,
                    normalize: bool = True, add_special: bool = True) -> EmbeddingRun:
        """embed()'s work, not yet run: the caller runs its passes one ``step()`` at a time
        (a server puts decode steps between them) until ``done``, then reads ``vectors``.

        Args, Raises: as embed().
        Returns:
            An EmbeddingRun; its ``inputs`` are the token ids of each input.
        """
        p = check_pooling(pooling or self.pooling)
        if isinstance(inputs, str):  # one text, not its characters
            inputs = [inputs]
        ids = [self.tokenize(x, add_special=add_special) if isinstance(x, str)
               else [int(t) for t in x] for x in inputs]
        for i, x in enumerate(ids):
            if x:
                check_tokens(x, self.vocab_size, f"input[{i}]")
        # Each pass reserves KV blocks for its tokens (an encoder's stay unwritten): at most
        # the pool's size.
        budget = min(max(self.settings.batch_size, 512), self._pool_tokens)
        return EmbeddingRun(self._runner, self.net, ids, p, budget, self.ctx,
                            self.new_sequence, normalize, self.settings.kv_block_size)

    def rerank_tokens(self, query: str, document: str) -> list[int]:
        """The tokens of one (query, document) pair as llama-server builds them: the file's
        rerank template with {query} and {document}, else [BOS] query [EOS] [SEP] doc [EOS]
        (each where the tokenizer adds it)."""
        tok = self.tokenizer
        template = self.metadata.get("tokenizer.chat_template.rerank")
        if isinstance(template, str):
            text = template.replace("{query}", query).replace("{document}", document)
            return tok.encode(text, add_special=False, parse_special=True)
        eos = tok.eos_id if tok.eos_id is not None else tok.special_id("sep")
        ids = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
        ids += tok.encode(query, add_special=False)
        if tok.add_eos and eos is not None:
            ids.append(eos)
        if tok.add_sep and tok.special_id("sep") is not None:
            ids.append(tok.special_id("sep"))
        ids += tok.encode(document, add_special=False)
        if tok.add_eos and eos is not None:
            ids.append(eos)
        return ids

    def rerank(self, query: str, documents: Seq[str]) -> list[float]:
        """Relevance of each document to the query, by the model's classification head.

        Returns:
            One score per document, in order (higher is more relevant).
        Raises:
            UnsupportedModel: not a reranker (its pooling is not rank).
        """
        run = self.start_rerank(query, documents)
        while not run.done:
            run.step()
        return [float(v[0]) for v in run.vectors]

    def start_rerank(self, query: str, documents: Seq[str]) -> EmbeddingRun:
        """rerank()'s work, not yet run (as start_embed): each document's score is
        ``vectors[i][0]`` once it is done.

        Raises:
            UnsupportedModel: not a reranker (its pooling is not rank).
        """
        if self.pooling != "rank":
            raise UnsupportedModel(f"this model pools by {self.pooling}, not rank: it is not a "
                                   "reranker", param="model")
        pairs = [self.rerank_tokens(query, d) for d in documents]
        return self.start_embed(pairs, pooling="rank")

    def infill_tokens(self, prefix: str | Seq[str | int], suffix: str | Seq[str | int],
                      extra: Seq[ExtraFile] = (), prompt: str = "", n_predict: int = -1,
                      spm: bool = False) -> list[int]:
        """The fill-in-the-middle prompt of llama-server's /infill (text/fim.py): extra
        files as repo-level context, then prefix, suffix and the middle token.

        Args:
            prefix, suffix: the text before and after the hole (or lists of texts and ids).
            extra: ExtraFile(filename, text) context; prompt: the start of the middle.
            n_predict: tokens the reply may take (-1: unbounded); spm: suffix first.
        Returns:
            Token ids to generate from.
        Raises:
            UnsupportedModel: the model has no FIM prefix, suffix or middle token.
        """
        return infill_tokens(self.tokenizer, prefix, suffix, extra, prompt, self.ctx,
                             n_predict, spm=spm)
