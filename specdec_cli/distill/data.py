"""Training text for self-distillation: the user's files, or the model's own answers to seed prompts.

The head learns what the target says, so the text it trains on is best the
target's own: prompts (built-in seeds, or the user's JSONL prompts/chats) are
answered by the target with batched generation. Plain text files are used as
they are. Either way the teacher signal is the target's own distribution at
every position (see :func:`teacher_states`), never the text's next token.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ..errors import OptionError
from ..model.taps import HiddenTap, TapSpec

# Seed prompts: topics x request kinds, far from the benchmark's evaluation
# prompts (scripts/bench.py: hash tables, Japan, a poem about the sea, Fibonacci, ...).
_TOPICS = (
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle",
    "volcanoes", "machine learning", "the Roman Empire", "vaccines", "plate tectonics", "recycling",
    "the stock market", "honey bees", "electric cars", "the human heart", "climate change", "chess",
    "the printing press", "rainforests", "sleep", "the moon landing", "coffee", "jazz music", "earthquakes",
    "solar panels", "the immune system", "ancient Egypt", "bread baking", "glaciers", "the internet",
    "democracy", "penguins", "gardening", "the Olympic Games", "DNA", "bicycles", "renewable energy",
    "the Silk Road", "mushrooms", "public libraries", "tides", "rainbows", "the periodic table", "gravity",
    "magnets", "batteries", "airplanes", "submarines", "bridges", "skyscrapers", "traffic lights", "trains",
    "the Great Wall of China", "the Renaissance", "the Industrial Revolution", "the Cold War", "the Vikings",
    "the Aztecs", "Shakespeare", "Mozart", "Leonardo da Vinci", "Marie Curie", "Isaac Newton",
    "Albert Einstein", "dinosaurs", "whales", "octopuses", "wolves", "elephants", "butterflies", "ants",
    "coral reefs", "deserts", "tundra", "wetlands", "rivers", "oceans", "clouds", "hurricanes", "tornadoes",
    "lightning", "snowflakes", "the seasons", "the solar system", "Mars", "Jupiter", "comets", "telescopes",
    "satellites", "rockets", "the International Space Station", "antibiotics", "nutrition", "exercise",
    "meditation", "stress", "memory", "dreams", "languages", "writing systems", "mathematics", "prime numbers",
    "probability", "statistics", "geometry", "algebra", "calculus", "cryptography", "computers",
    "operating systems", "databases", "programming languages", "open-source software", "video games",
    "social media", "smartphones", "email", "cloud computing", "robots", "3D printing", "virtual reality",
    "drones", "money", "inflation", "taxes", "banks", "small businesses", "marketing", "job interviews",
    "teamwork", "leadership", "time management", "public speaking", "volunteering", "friendship", "parenting",
    "school uniforms", "homework", "universities", "museums", "theaters", "photography", "painting",
    "sculpture", "poetry", "novels", "comics", "cinema", "football", "basketball", "tennis", "swimming",
    "running", "yoga", "mountain climbing", "camping", "fishing", "sailing", "cooking pasta", "tea",
    "chocolate", "cheese", "spices", "fermentation", "vegetarian diets", "farming", "irrigation", "forests",
    "trees", "flowers", "seeds", "soil", "composting", "water pollution", "air quality", "plastic waste",
    "urban planning", "public transport", "architecture", "castles", "pyramids", "lighthouses", "maps",
    "compasses", "clocks", "calendars", "the alphabet", "postal services", "newspapers", "radio", "television",
    "podcasts",
)
_KINDS = (
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Give a brief history of {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short story that involves {t}.",
    "Describe {t} in simple terms, then give an example.",
    "Write a blog post introduction about {t}.",
    "What questions do people often ask about {t}? Answer two of them.",
    "Summarize the most important ideas about {t} in a few bullet points.",
    "Write a friendly letter to a friend describing {t}.",
    "What would a beginner get wrong about {t}?",
)
_TASKS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a JavaScript function that removes duplicates from an array.",
    "Write a SQL query that finds the five most expensive products in a table.",
    "Write a Python script that counts the words in a text file.",
    "Write a bash command that lists the ten largest files in a directory.",
    "Write a Python function that merges two sorted lists.",
    "Explain the difference between a list and a tuple in Python.",
    "Write an email to a colleague asking to move a meeting to Friday.",
    "Write a polite message declining an invitation to a party.",
    "Plan a three-day trip to a mountain village.",
    "Give me a recipe for a simple vegetable soup.",
    "How do I change a flat tire? List the steps.",
    "A train travels 120 km in 2 hours. What is its average speed? Explain.",
    "If I save 50 dollars a month, how much will I have after two years?",
    "Write a dialogue between a teacher and a student about homework.",
    "Describe a sunset over the desert.",
    "Write a product description for a reusable water bottle.",
    "What should I consider when adopting a dog?",
    "Write a limerick about a cat who loves to cook.",
)


def seed_prompts(seed: int = 0) -> list[str]:
    """The built-in seed prompts (topics x request kinds, plus tasks), shuffled by ``seed``."""
    prompts = [k.format(t=t) for t in _TOPICS for k in _KINDS] + list(_TASKS) * 3
    random.Random(seed).shuffle(prompts)
    return prompts


Prompt = Union[str, list]  # a user message, or a chat (list of {"role", "content"})


@dataclass
class Source:
    """What the head trains on: prompts for the target to answer, and/or plain texts.

    Attributes:
        prompts: Prompts (or chats) for the target to answer.
        texts: Texts used as they are.
        description: What is on offer (before any of it is used).
        digest: A hash of the content (the files' bytes, or the seed prompts), for the corpus cache key.
        origin: Where it comes from (``from PATH``), or "" for the built-in seed prompts.
    """

    prompts: list[Prompt] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    description: str = ""
    digest: str = ""
    origin: str = ""

    def used(self, texts: int, answers: int) -> str:
        """What a corpus of ``texts`` texts and ``answers`` answered prompts took from this source."""
        if not self.origin:
            return f"the model's answers to {answers} built-in seed prompts"
        parts = []
        if answers:
            distinct = len(self.prompts)
            parts.append(f"the model's answers to {answers} prompts" if answers <= distinct
                         else f"{answers} answers of the model to {distinct} prompts")
        if texts:
            parts.append(f"{texts} text(s)")
        return " and ".join(parts or ["nothing"]) + f" {self.origin}"


_TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".js", ".ts", ".c", ".cc", ".cpp", ".h", ".rs", ".go", ".java",
                  ".html", ".css", ".json", ".yaml", ".yml", ".toml", ".tex", ".csv")


def data_path(path: str) -> Path:
    """``--data``'s file or directory.

    Raises:
        OptionError: It is not there.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise OptionError(f"--data {path}: no such file or directory")
    return root


def read_source(path: Optional[str], seed: int = 0) -> Source:
    """The training source named by ``--data`` (None: the built-in seed prompts).

    A directory contributes every text and ``.jsonl`` file under it. JSONL
    lines are ``{"prompt": str}`` or ``{"messages": [...]}`` (answered by the
    target) or ``{"text": str}`` (used as is); other files are plain text.

    Raises:
        OptionError: The path is missing, empty or unreadable.
    """
    if path is None:
        prompts = seed_prompts(seed)
        digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
        return Source(prompts=list(prompts), digest=digest,
                      description=f"the model's answers to built-in seed prompts ({len(prompts)} available)")
    root = data_path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    files = [f for f in files if f.suffix in _TEXT_SUFFIXES + (".jsonl",)] if root.is_dir() else files
    source = Source(origin=f"from {path}")
    digest = hashlib.sha256()
    for f in files:
        try:
            raw = f.read_bytes()
            text = raw.removeprefix(codecs.BOM_UTF8).decode("utf-8")  # a BOM (Windows editors) is no text
        except (OSError, UnicodeDecodeError) as e:
            raise OptionError(f"--data: cannot read {f}: {e}") from None
        # The content decides whether a cached corpus is reused, not the path (see pipeline._corpus_key).
        name = str(f.relative_to(root)) if root.is_dir() else ""
        digest.update(f"{name}\0{len(raw)}\0".encode() + raw)
        if f.suffix == ".jsonl":
            _read_jsonl(f, text, source)
        elif text.strip():
            source.texts.append(text)
    if not source.prompts and not source.texts:
        raise OptionError(f"--data {path}: no text found (give text files, a directory of them, or JSONL "
                          'lines with "prompt", "messages" or "text")')
    parts = []
    if source.prompts:
        parts.append(f"the model's answers to {len(source.prompts)} prompts")
    if source.texts:
        parts.append(f"{len(source.texts)} text(s)")
    source.description = " and ".join(parts) + f" from {path}"
    source.digest = digest.hexdigest()
    return source


def _read_jsonl(f: Path, text: str, source: Source) -> None:
    # At "\n" only: splitlines() also broke at U+2028 and U+0085, which JSON strings may hold raw.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise OptionError(f"--data: {f} line {n} is not JSON ({e.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list):
            messages = row["messages"]
            # Else a crash ("'str' object has no attribute 'get'") after loading; the content is the template's
            # to read (null beside tool_calls, a list of parts), as it renders agents' traces.
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise OptionError(f'--data: {f} line {n}: "messages" must be a list of '
                                  '{"role": ..., "content": ...} objects')
            # A chat ending in an assistant turn: the target answers the turns before it.
            if messages and messages[-1].get("role") == "assistant":
                messages = messages[:-1]
            if messages:
                source.prompts.append(messages)
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            source.prompts.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            source.texts.append(row["text"])
        else:
            raise OptionError(f'--data: {f} line {n} has none of "prompt", "messages" or "text"')


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt as the target sees it in a chat (its template when it has one)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode("\n".join(m["content"] for m in messages)))


@dataclass
class Generated:
    """Progress of the target answering prompts: corpus tokens so far (prompts and answers), of the goal."""

    tokens: int
    goal: int
    answered: int = 0  # prompts answered (each kept, possibly cut at the goal)
    timed_out: bool = False  # the deadline stopped generation: answers cut short, no batch after this one


def answer_prompts(model: nn.Module, tokenizer, prompts: Sequence[Prompt], goal_tokens: int, max_tokens: int,
                   batch_size: int, temp: float, seed: int, out: list[list[int]],
                   deadline: Optional[float] = None) -> Iterator[Generated]:
    """Have the target answer ``prompts`` (cycling) until ``goal_tokens`` tokens are collected.

    Each finished sequence (prompt + answer ids) is appended to ``out``, the
    last one cut so that exactly ``goal_tokens`` are kept (a sequence cut
    inside its prompt is dropped: it has nothing of the model's). Each batch
    holds only as many prompts as the remaining budget can use, so a small
    goal does not generate a full batch of long answers. Generation is
    batched (mlx-lm's ``BatchGenerator``): on a CPU a batch costs little more
    per step than one row. At ``deadline`` (a ``time.perf_counter()`` time)
    generation stops after its current step, keeping the answers so far; the
    last event says so (``timed_out``).
    """
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp=temp)
    total, i, answered = 0, 0, 0
    while total < goal_tokens and prompts:
        if _past(deadline):
            yield Generated(total, goal_tokens, answered, timed_out=True)
            return
        remaining = goal_tokens - total
        batch, room = [], 0
        while len(batch) < batch_size and room < remaining:
            ids = prompt_ids(tokenizer, prompts[(i + len(batch)) % len(prompts)])
            batch.append(ids)
            room += len(ids) + max_tokens
        i += len(batch)
        added = 0
        answers, timed_out = _answers(model, tokenizer, batch, min(max_tokens, remaining), sampler, deadline)
        for ids, answer in zip(batch, answers):
            seq = (list(ids) + answer)[: goal_tokens - total]
            if len(seq) <= len(ids):
                continue  # the budget ends inside the prompt (or the deadline before the answer)
            out.append(seq)
            total += len(seq)
            added += 1
        answered += added
        yield Generated(total, goal_tokens, answered, timed_out)
        if timed_out or not added:
            break  # (not added: the prompts left are longer than the budget left)


def _past(deadline: Optional[float]) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def _answers(model: nn.Module, tokenizer, batch: list[list[int]], max_tokens: int, sampler,
             deadline: Optional[float]) -> tuple[list[list[int]], bool]:
    """Each prompt's answer ids (an EOS not included), generated together, and whether ``deadline`` cut them.

    mlx-lm's ``batch_generate`` loop, with the deadline checked at every step: a long batch on a slow machine
    must not run past a time limit.
    """
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids], sampler=sampler)
    timed_out = False
    try:
        uids = gen.insert(batch, [max_tokens] * len(batch))
        answers: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    answers[r.uid].append(int(r.token))
            if _past(deadline):
                timed_out = True
                break
    finally:
        gen.close()
    return [answers[uid] for uid in uids], timed_out


def text_ids(tokenizer, texts: Sequence[str], goal_tokens: int, out: list[list[int]],
             piece: int = 2048) -> tuple[int, int]:
    """Tokenize plain texts (until ``goal_tokens``) into ``out``, in pieces of at most ``piece`` tokens.

    Long files are cut so that the target's states come from bounded caches.
    Returns the tokens added and how many of ``texts`` were used (the last possibly cut).
    """
    total = used = 0
    for text in texts:
        if total >= goal_tokens:
            break
        ids = list(tokenizer.encode(text))[: goal_tokens - total]
        if not ids:
            continue
        out += [ids[i:i + piece] for i in range(0, len(ids), piece)]
        total += len(ids)
        used += 1
    return total, used


def teacher_states(model: nn.Module, sequences: Sequence[Sequence[int]], chunk: int = 512) -> Iterator[mx.array]:
    """The target's final-normed hidden states ``[T, H]`` of each sequence, in order.

    The lm_head of these rows gives the target's distribution at every
    position: the soft labels the head is trained on. Sequences longer than
    ``chunk`` are run in pieces through one cache.
    """
    from mlx_lm.models.cache import make_prompt_cache

    with HiddenTap(model, TapSpec(final=True)) as tap:
        for seq in sequences:
            cache = make_prompt_cache(model)
            rows = []
            for start in range(0, len(seq), chunk):
                ids = mx.array(seq[start:start + chunk], dtype=mx.uint32)[None]
                # Only the backbone's states are needed; the logits are never evaluated.
                model(ids, cache=cache)
                rows.append(tap.take().final)
                mx.eval(rows[-1])
            yield mx.concatenate(rows) if len(rows) > 1 else rows[0]
