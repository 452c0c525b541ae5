"""The `logits` section of make_fixtures.py: llama.cpp's teacher-forced log-probabilities over a
~400-token passage and its greedy continuations of sixty prompts, for both real models.

Only the top 64 log-probabilities per position are stored (the tests compare distributions
coarsened to those tokens plus one bucket for the rest). llama.cpp's own disagreement with
itself (token by token instead of one batch) is stored too, as the scale for our agreement.
"""

from __future__ import annotations

import numpy as np

PASSAGE = (
    "The history of the printing press is often told as the story of one man in Mainz, but the "
    "machine Johannes Gutenberg assembled around 1450 drew on many older crafts. Screw presses "
    "had squeezed grapes and olives for centuries; paper had travelled west from China through "
    "the Islamic world; and metalworkers already knew how to cast small, precise shapes. What was "
    "new was the combination: a hand mould that could produce thousands of identical letters, an "
    "alloy of lead, tin and antimony that melted easily and cooled quickly, and an oil-based ink "
    "that clung to metal instead of running off it.\n\n"
    "Within fifty years, presses were working in more than two hundred European towns. Printers "
    "were businessmen first. They chose books they expected to sell, such as grammars, calendars, "
    "sermons and legal handbooks, and they borrowed money to buy paper, which was by far the "
    "largest expense. Many went bankrupt. Those who survived learned to print pamphlets quickly "
    "when a controversy made people eager to read, and the religious disputes of the sixteenth "
    "century gave them plenty of work.\n\n"
    "Historians still argue about how much the press changed the way people thought. Some stress "
    "that standard texts allowed scholars in distant cities to compare the same page and correct "
    "one another. Others point out that early printed books were full of errors, that most people "
    "could not read, and that handwritten copies remained common for a long time. Both views "
    "contain some truth. The press did not create modern science or the Reformation by itself, "
    "but it made ideas cheaper to copy, harder to suppress, and easier to argue about in public. "
    "That, more than any single invention, is why the workshop in Mainz is remembered today.\n\n"
    "A modern reader can still visit the museum in that city and watch a replica press at work. "
    "The guide inks the type, lays a damp sheet on top, pulls the long wooden bar, and lifts out "
    "a page that looks, at first glance, almost exactly like the ones sold there five centuries ago."
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "Here is a list of the planets in our solar system:\n1.",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, you first",
    "The quick brown fox",
    "In machine learning, overfitting means",
    "My favourite book is",
    "The largest ocean on Earth is",
    "Photosynthesis is the process by which",
    "The French Revolution began in",
    "import numpy as np\n\ndef normalize(x):\n    ",
    "A haiku about autumn:\n",
    "The recipe calls for two cups of",
    "Dear Sir or Madam,\n\nI am writing to",
    "The mitochondria is",
    "SELECT name, age FROM users WHERE",
    "The best way to learn a new language is",
    "In 1969, astronauts",
    "Q: What is 12 times 12?\nA:",
    "The theory of relativity states that",
    "My grandmother always told me",
    "The stock market fell sharply today after",
    "<html>\n<head>\n<title>",
    "Rain is formed when",
    "The main causes of the First World War were",
    "for i in range(10):\n    print(",
    "A good night's sleep helps",
    "The Eiffel Tower was built",
    "Translate to French: Good morning ->",
    "The human heart has four",
    "Once there was a dragon who",
    "The difference between weather and climate is",
    "function add(a, b) {\n  return",
    "Bees are important because",
    "The Amazon rainforest",
    "Step 1: Preheat the oven to",
    "Shakespeare wrote",
    "The speed of light is approximately",
    "In a democracy, citizens",
    "The moon orbits",
    "Electric cars are becoming popular because",
    "The word 'algorithm' comes from",
    "To solve a quadratic equation,",
    "The Great Wall of China",
    "My plan for the weekend is to",
    "Volcanoes erupt when",
    "The meeting has been moved to",
    "The cat sat on the",
    "A healthy breakfast includes",
    "The Internet was originally developed",
    "Newton's first law says that",
    "The river flowed quietly through",
    "class Stack:\n    def __init__(self):\n        ",
    "The most spoken languages in the world are",
    "Mount Everest is located",
    "Dogs are known for their",
    "The answer to the riddle is",
]
TOPK = 64
GREEDY_TOKENS = 32
THREADS = 2


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def coarse_kl(top_ids: np.ndarray, top_lp: np.ndarray, other_lp: np.ndarray) -> np.ndarray:
    """KL(reference || other) per position over the reference's top tokens plus the rest."""
    p = np.exp(top_lp)
    q = np.exp(np.take_along_axis(other_lp, top_ids, 1))
    P, Q = p.sum(1), q.sum(1)
    rest = (1 - P) * np.log(np.maximum(1 - P, 1e-12) / np.maximum(1 - Q, 1e-12))
    return (p * (top_lp - np.log(q))).sum(1) + rest


def all_logits(path: str, ids: list[int], n_batch: int, n_ctx: int = 1024) -> np.ndarray:
    """llama.cpp's logits at every position of ``ids``, fed in batches of ``n_batch``."""
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=THREADS, n_batch=n_batch, n_ubatch=n_batch,
                          logits_all=True, verbose=False, seed=0)
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)
    llm.close()
    return out


def logits_doc(path: str) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=1024, n_threads=THREADS, n_batch=512, verbose=False, seed=0)
    ids = [int(i) for i in llm.tokenize(PASSAGE.encode(), add_bos=True, special=False)]
    greedy = []
    for prompt in PROMPTS:
        pids = [int(i) for i in llm.tokenize(prompt.encode(), add_bos=True, special=False)]
        out = []
        for t in llm.generate(pids, temp=0.0, top_k=1, reset=True):
            out.append(int(t))
            if len(out) >= GREEDY_TOKENS or t == llm.token_eos():
                break
        greedy.append({"prompt": prompt, "prompt_ids": pids, "continuation": out})
    llm.close()
    lp = log_softmax(all_logits(path, ids, 512))
    top = np.argsort(-lp, axis=1, kind="stable")[:, :TOPK]
    top_lp = np.take_along_axis(lp, top, 1)
    seq = log_softmax(all_logits(path, ids, 1))  # llama.cpp one token at a time
    # llama.cpp's greedy text was made token by token; score it teacher-forced in one batch
    hits = total = 0
    for g in greedy:
        n_prompt, cont = len(g["prompt_ids"]), np.array(g["continuation"])
        z = all_logits(path, g["prompt_ids"] + g["continuation"], 512)
        hits += int((z[n_prompt - 1:n_prompt - 1 + len(cont)].argmax(1) == cont).sum())
        total += len(cont)
    return {
        "about": "llama.cpp (llama-cpp-python %s, %d threads): passage ids with BOS, top-%d "
                 "log-probs per position from one batch of 512, argmax, greedy continuations; "
                 "self: llama.cpp token-by-token against its own batch, and its batched argmax along "
                 "its greedy continuations" % (
                     llama_cpp.__version__, THREADS, TOPK),
        "passage": PASSAGE, "ids": ids, "topk": TOPK,
        "top_ids": top.astype(int).tolist(),
        "top_logprobs": np.round(top_lp, 5).tolist(),
        "argmax": [int(i) for i in lp.argmax(1)],
        "greedy": greedy,
        "self": {"top1": float((seq.argmax(1) == lp.argmax(1)).mean()),
                 "kl_mean": float(coarse_kl(top, top_lp, seq).mean()),
                 "greedy": hits / total},
    }


def section_logits(args, model_path, write_json, fixtures) -> None:
    for name in ("smollm", "gemma"):
        write_json(fixtures / "logits" / f"{name}_logits.json", logits_doc(model_path(name)))
