#!/usr/bin/env python3
"""Write tests/fixtures/tokenizer/bert_bge_multilingual.json: texts in many scripts and the
ids llama.cpp (the llama_cpp package) gives for them with llama.cpp's bert-bge vocabulary
(from `scripts/fetch_models.py --vocab-suite`), no special tokens added or parsed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from localllm.formats.fetch import vocab_suite_dir

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tokenizer" / \
    "bert_bge_multilingual.json"

TEXTS = [
    "Grüße aus Köln: Die Straße ist naß, Ärger über Öl.",
    "Ça coûte déjà 12,50 € — n'est-ce pas ? Où êtes-vous allés…",
    "¿Dónde está el niño? ¡Mañana llegará a la estación!",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Καλημέρα κόσμε· η ΑΘΗΝΑ είναι πρωτεύουσα.",
    "東京都の人口は約1400万人です。北京欢迎你！",
    "한국어 문장도 섞어 봅니다: 서울특별시, 2024년.",
    "مرحبا بالعالم، هذا اختبار.",
    "שלום עולם, זה מבחן קצר.",
    "नमस्ते दुनिया। यह एक परीक्षण है।",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง",
    "İstanbul'da ılık bir gün; ŞEKER ve çay.",
    "Tiếng Việt có nhiều dấu: Hà Nội, Huế, Sài Gòn.",
    "Zero\u200bwidth, soft\u00adhyphen, tab\there, NBSP\u00a0here, e\u0301 composed.",
    "Emoji 🙂👍🏽 and symbols ©®™ ±×÷ √∞ ≠ ≤ ≥ ½ ¾ ①②.",
    "ＦＵＬＬＷＩＤＴＨ ｌｅｔｔｅｒｓ and ﬁ ligatures, Ⅻ numerals.",
    "Mixed: naïve café résumé coöperate façade 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-dir", default=None, help="the vocab suite folder")
    args = ap.parse_args(argv)
    import llama_cpp  # the reference implementation, only for writing the fixture

    path = vocab_suite_dir(args.vocab_dir) / "ggml-vocab-bert-bge.gguf"
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    cases = [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=False, special=False)}
             for t in TEXTS]
    doc = {"source": f"llama_cpp {llama_cpp.__version__}, {path.name}, "
                     "tokenize(add_special=False, parse_special=False)",
           "cases": cases}
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    OUT.write_text(f'{{"source": {json.dumps(doc["source"])},\n "cases": [\n{body}\n]}}\n',
                   encoding="utf-8")
    print(f"{OUT}: {len(cases)} texts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
