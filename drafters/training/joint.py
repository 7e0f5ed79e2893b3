"""Joint training (semi-autoregressive drafting, §4.2): a LoRA on the target trained together with its drafter.

The objective, with λ in [0, 1]:

    J = L_draft(h_λ) + (1 − λ) · L_LM,     h_λ = λ · sg(h) + (1 − λ) · h

h is the LoRA-adapted target's final-norm output over the batch (computed with gradient), L_draft the base
method's own loss reading it as its features, and L_LM the adapted target's cross-entropy on the data's own
answers (a domain slice's ground truth). λ scales what reaches the LoRA: the LM loss and the share of the
drafter's gradient that flows into the target's features. The drafter always sees h's values, rounded to
float16 as stored features are.

Rules: λ = 1 is separate training: no gradient reaches the LoRA (its B starts at zero, so the target's
output is unchanged), and the drafter's steps are those of training on features computed on the fly by the
frozen target (a test holds it bit for bit). The checkpoint is the drafter's own, so its base method decodes
it; beside it, ``target/`` holds the adapted target with the LoRA merged (load it with ``--target``) and
``lora/`` the adapter alone.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specviz.core.errors import SettingsError
from specviz.core.packing import plain_copy

from ..trained import TrainedDrafter

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@contextlib.contextmanager
def quiet_peft():
    """peft asks transformers a question it has renamed (a FutureWarning on every call); the answer is the same."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


@dataclass(frozen=True)
class JointOptions:
    lam: float = 0.25  # 1: separate training
    rank: int = 8
    alpha: int = 16

    def __post_init__(self) -> None:
        if not 0.0 <= self.lam <= 1.0 or self.rank < 1:
            raise SettingsError(f"joint training needs 0 <= lambda <= 1 and a rank >= 1, got {self}")


class JointNet(nn.Module):
    """The drafter's network and a LoRA-adapted copy of the target, trained together. Its state is the
    trainable part alone (the drafter and the LoRA weights): the copied base weights are the target's."""

    def __init__(self, drafter: nn.Module, target, opts: JointOptions):
        super().__init__()
        from peft import LoraConfig, get_peft_model

        self.drafter = drafter  # built first: its initialisation draws what separate training's draws
        config = LoraConfig(r=opts.rank, lora_alpha=opts.alpha, lora_dropout=0.0, target_modules=list(LORA_MODULES))
        with quiet_peft():
            self.lm = get_peft_model(plain_copy(target.model), config)

    def body(self, tokens: torch.Tensor) -> torch.Tensor:
        """The adapted target's final-norm output over ``tokens`` [B, T] (causal: right padding is harmless)."""
        return self.lm.get_base_model().get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state

    def lora_parameters(self) -> int:
        return sum(p.numel() for n, p in self.lm.named_parameters() if "lora_" in n)

    def _trainable(self, name: str) -> bool:
        return name.startswith("drafter.") or "lora_" in name

    def state_dict(self, *args, **kwargs):
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if self._trainable(k)}

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state, strict=False, assign=assign)
        wrong = [k for k in result.missing_keys if self._trainable(k)] + list(result.unexpected_keys)
        if strict and wrong:
            raise RuntimeError(f"joint state does not fit: {wrong[:4]}")
        return result

    def merged_target(self) -> nn.Module:
        """A copy of the adapted target with the LoRA merged into its weights."""
        with quiet_peft():
            return copy.deepcopy(self.lm).merge_and_unload()


def lm_loss(net: JointNet, h: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The adapted target's cross-entropy of token t+1 at each answer position t."""
    rows = valid[:, :-1].nonzero(as_tuple=True)
    head = net.lm.get_base_model().get_output_embeddings()
    logits = head(h[:, :-1][rows]).float()
    return F.cross_entropy(logits, tokens[:, 1:][rows])


def joint_class(base: type[TrainedDrafter], opts: JointOptions) -> type[TrainedDrafter]:
    """``base`` trained jointly with a LoRA on the target: a training variant whose checkpoint ``base`` decodes."""
    if not base.reads_features or base.tapped_layers(8):
        raise SettingsError(f"joint training reads the target's final-norm output; {base.name} reads other inputs")

    class Joint(base):
        variant_name = f"{base.name}-joint{opts.lam:g}"
        joint = opts
        title = f"{base.title} [joint with a rank-{opts.rank} LoRA on the target, lambda {opts.lam:g}]"

        @classmethod
        def new_network(cls, target, **shape) -> JointNet:
            return JointNet(base.new_network(target, **shape), target, opts)

        @classmethod
        def training_loss(cls, net, frozen, tokens, feats, valid, evaluate: bool = False, done: float = 1.0):
            h = net.body(tokens)
            lam = opts.lam
            mixed = h.detach() if lam == 1 else h if lam == 0 else lam * h.detach() + (1 - lam) * h
            stored = mixed + (mixed.half().to(mixed.dtype) - mixed).detach()  # the values, rounded as stored
            loss, stats = base.training_loss(net.drafter, frozen, tokens, stored, valid, evaluate, done)
            if lam < 1:
                lm = lm_loss(net, h, tokens, valid)
                loss = loss + (1 - lam) * lm
                stats["lm_loss"] = float(lm.detach())
            return loss, stats

        @classmethod
        def drafter_network(cls, net: JointNet) -> nn.Module:
            return net.drafter

        @classmethod
        def save_extras(cls, net: JointNet, folder: Path, target) -> dict:
            merged = net.merged_target()
            merged.save_pretrained(folder / "target")
            if getattr(target.text, "tokenizer", None) is not None:
                target.text.tokenizer.save_pretrained(folder / "target")
            with quiet_peft():
                net.lm.save_pretrained(folder / "lora")
            return {**asdict(opts), "lora_parameters": net.lora_parameters(), "target": "target",
                    "adapter": "lora"}

    Joint.__name__ = Joint.__qualname__ = f"{base.__name__}[joint {opts.lam:g}]"
    return Joint
