"""The jointly trained target beside the server's own (``--joint FOLDER``), so the two can be raced.

Joint training (``drafters.training.joint``, semi-autoregressive drafting §4.2) trains a LoRA on the target
together with the drafter; its checkpoint holds the drafter and, under ``target/``, the adapted target with
the LoRA merged. The app loads that target beside the base one, on the same engine thread, with the joint
drafter and every method that needs no training. A column tagged "(joint)" runs on it:

- "ar (joint)" is the adapted target's own text: what joint training did to the target's answers;
- "semi-attn (joint)" is the joint drafter at the base column's budget, so the two columns' τ differ by the
  training alone. It is lossless against the adapted target: its badge compares it with "ar (joint)".

Rules: other trained methods are not offered there (their checkpoints learned the base target's features);
the adapted target is not tuned, its columns take the base method's budget; it is loaded in the base
target's dtype (the precision switch's other copy loads its own).
"""

from __future__ import annotations

import json
from pathlib import Path

from drafters import METHODS
from specviz.core.errors import SpecvizError
from specviz.core.load import load_target

from .state import AppState, JointTarget

TAG = "joint"  # a column on the adapted target: "ar (joint)", "semi-attn (joint)"


def joint_card(folder: str | Path) -> tuple[str, Path]:
    """The method a joint checkpoint's drafter is for, and its adapted target's folder; SpecvizError else."""
    folder = Path(folder).expanduser()
    card_file = folder / "card.json"
    if not card_file.is_file():
        raise SpecvizError(f"--joint {folder}: no card.json there (a checkpoint of `specviz train --joint`)")
    try:
        card = json.loads(card_file.read_text())
    except (OSError, ValueError) as e:
        raise SpecvizError(f"--joint {folder}: card.json cannot be read ({e})") from None
    joint = card.get("joint") if isinstance(card, dict) else None
    if not isinstance(joint, dict) or not isinstance(joint.get("target"), str):
        raise SpecvizError(f"--joint {folder}: not a joint checkpoint (its card names no adapted target; train one "
                           "with `python -m specviz train --drafter semi-attn --joint`)")
    method, target = card.get("method"), folder / joint["target"]
    if method not in METHODS:
        raise SpecvizError(f"--joint {folder}: its card names an unknown method {str(method)[:40]!r}")
    if not (target / "config.json").is_file():
        raise SpecvizError(f"--joint {folder}: the adapted target {target} is missing")
    return method, target


def load_joint(main: AppState, folder: str | Path) -> JointTarget:
    """The adapted target of the joint checkpoint ``folder``, loaded beside ``main``'s on its engine thread."""
    method, target_folder = joint_card(folder)
    dtype = str(main.target.dtype).replace("torch.", "")
    model = main.on_engine(load_target, str(target_folder), dtype, str(main.target.device))
    if model.text.encode_chat("Hi.") != main.target.text.encode_chat("Hi."):
        raise SpecvizError(f"--joint {folder}: its target's tokenizer is not the server's target's")
    left_out = tuple(m for m, (cls, _) in METHODS.items() if cls.trained and m != method)
    state = AppState(model, configured={method: {"checkpoint": str(Path(folder).expanduser())}},
                     engine=main.engine, left_out=left_out)
    state.on_engine(state.load_drafters)
    for m in left_out:
        state.unavailable[m] = f"only {method}'s joint checkpoint runs there (the others learned the base target)"
    if method in state.unavailable:
        raise SpecvizError(f"--joint {folder}: {method} cannot run on its adapted target ({state.unavailable[method]})")
    return JointTarget(Path(folder), method, state)


def joint_settings(main: AppState, joint: JointTarget, name: str) -> dict:
    """A joint column's starting settings: the base column's (this machine's budget for ``name``), with the
    joint checkpoint in place of the base one."""
    start = {k: v for k, v in main.preset(name).items() if k != "checkpoint"}
    return {**start, **joint.state.configured.get(name, {})}
