"""Classic two-model speculative sampling: any assistant LM that shares the target's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from specviz.core.errors import SettingsError
from specviz.core.protocol import BudgetGrid, Settings

from .chain_lm import ChainLMDrafter


@dataclass
class AssistantSettings(Settings):
    assistant: str = ""  # HF id or folder of the assistant model
    num_tokens: int = 4
    dtype: str = "float32"
    ranges = {"num_tokens": (1, 32)}

    @classmethod
    def budget_grids(cls, target) -> list[BudgetGrid]:
        return [BudgetGrid("num_tokens")]


def check_same_vocab(target, model, tokenizer) -> None:
    mine = target.text.tokenizer
    if mine is not None and tokenizer is not None:
        if mine.get_vocab() != tokenizer.get_vocab():
            raise SettingsError("the assistant's tokenizer differs from the target's; "
                                "speculative sampling needs the same one")
    rows = model.get_output_embeddings().weight.shape[0]
    if rows < target.vocab_size:
        raise SettingsError(f"the assistant has {rows} vocabulary rows; the target needs {target.vocab_size}")


class AssistantDrafter(ChainLMDrafter):
    name = "sps"
    title = "Two-model speculative sampling (assistant LM)"

    def __init__(self, target, settings: AssistantSettings | None = None, model=None, tokenizer=None):
        self.settings = settings or AssistantSettings()
        if model is None:
            if not self.settings.assistant:
                raise SettingsError("sps needs an assistant model with the target's tokenizer: "
                                    "set assistant=<HF id or folder> (the app: --assistant)")
            from specviz.core.load import load_causal_lm

            model, tokenizer = load_causal_lm(self.settings.assistant, self.settings.dtype, str(target.device))
        check_same_vocab(target, model, tokenizer)
        super().__init__(model, self.settings.num_tokens, target.vocab_size)
