"""Text around a target: a user turn through the chat template, ids back to text, and the EOS ids.

The decode loop only needs token ids; this helper is what turns a prompt into them and tells the loop
where to stop. It holds no model, only the tokenizer and the EOS ids read once from the model's
configs (``ChatText.for_model``), so changing a config afterwards needs a new helper.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecvizError


class TextError(SpecvizError):
    """Text that cannot become token ids (no tokenizer, invalid UTF-8)."""


def eos_token_ids(model, tokenizer=None) -> frozenset[int]:
    """The ids that end a turn: the generation config's, else the model config's, else the tokenizer's.
    An id of 0 is a real id, not "unset"."""
    declared = (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(getattr(model, "config", None), "eos_token_id", None))
    ids = next((i for i in declared if i is not None), None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset(ids) if isinstance(ids, (list, tuple)) else frozenset({int(ids)})


@dataclass
class ChatText:
    """A tokenizer (or none: ids are shown as numbers) and the EOS ids of the model it serves."""

    tokenizer: object | None = None
    eos_token_ids: frozenset[int] = frozenset()

    @classmethod
    def for_model(cls, model, tokenizer=None) -> ChatText:
        return cls(tokenizer, eos_token_ids(model, tokenizer))

    def encode_chat(self, prompt: str) -> list[int]:
        """Token ids of a single user turn, through the chat template when the tokenizer has one."""
        if self.tokenizer is None:
            raise TextError("this target has no tokenizer; pass token ids instead of text")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8 (a shell argument, a raw API body)
            raise TextError("the prompt is not valid UTF-8 text") from None
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.tokenizer.encode(prompt)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else " ".join(map(str, ids))
