"""specviz: watch speculative-decoding drafters race side by side (Gradio).

    python app.py [--target HF_ID_OR_FOLDER] [--assistant HF_ID_OR_FOLDER] [--drafters DIR] [--device cuda]
                  [--drafter METHOD=HF_ID_OR_FOLDER ...] [--dtype bfloat16] [--tune background|now|off]
                  [--methods ar,pld,eagle2] [--joint JOINT_CHECKPOINT]
    # or SPECVIZ_TARGET / _ASSISTANT / _DRAFTERS / _DRAFTER / _METHODS (comma-separated) / _JOINT / _DEVICE / _DTYPE
    # / _TUNE;
    # GRADIO_SERVER_NAME / GRADIO_SERVER_PORT

The target and every drafter load once, in ``main`` (never in gr.State), into one ``AppState``; the
modules of ``specviz.apps.web`` plan requests, draw the views and lay out the page around it.
"""

from __future__ import annotations

import argparse
import os
import sys

from specviz.apps.web.space import install_space_packages
from specviz.apps.web.starting import StartingPage
from specviz.core.files import missing_folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=env("SPECVIZ_TARGET"), help="HF model id or folder (default: embedded)")
    p.add_argument("--assistant", default=env("SPECVIZ_ASSISTANT"), help="assistant LM for sps (same tokenizer)")
    p.add_argument("--drafters", default=env("SPECVIZ_DRAFTERS"),
                   help="checkpoints trained for this target: a folder with one subfolder per method (eagle2/, ...)")
    p.add_argument("--drafter", action="append", metavar="METHOD=HF_ID_OR_FOLDER",
                   default=[d for d in env("SPECVIZ_DRAFTER", "").split(",") if d.strip()],
                   help="a method's checkpoint, specviz's own or a published EAGLE-1/2, HASS, EAGLE-3, speculators "
                        "or Medusa one, e.g. eagle3=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (repeatable)")
    p.add_argument("--device", default=env("SPECVIZ_DEVICE"), help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", default=env("SPECVIZ_DTYPE", "float32"),
                   help="float32 (the default: exact, so every lossless method shows the target's own text), auto "
                        "(bf16 where the hardware is fast at it, else float32), bfloat16 or float16 (faster; "
                        "lossless methods may then part from AR at near-ties)")
    p.add_argument("--tune", default=env("SPECVIZ_TUNE", "background"), choices=("background", "now", "off"),
                   help="each method's budget for this machine: measured while the page serves (default), "
                        "before it serves, or not at all (untuned defaults)")
    p.add_argument("--engine", default=env("SPECVIZ_ENGINE", "eager"), choices=("eager", "compiled", "auto"),
                   help="the target's forwards: eager (the default), or compiled with torch.compile (CUDA graphs on "
                        "a GPU), done on a thread while the page serves eager; each column says which path ran")
    p.add_argument("--methods", type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
                   default=env("SPECVIZ_METHODS", ""),
                   help="comma-separated methods to load, e.g. ar,pld,eagle2 (default: all); the others get no "
                        "column and are neither built nor tuned, so the page starts and tunes sooner")
    p.add_argument("--joint", default=env("SPECVIZ_JOINT"),
                   help="a checkpoint of joint training (`specviz train --drafter semi-attn --joint`): its "
                        "LoRA-adapted target is loaded beside this one, and columns tagged (joint) race on it")
    return p.parse_known_args(argv)[0]


def missing_folders(args: argparse.Namespace) -> str | None:
    """A folder named on the command line that is not there, said before anything heavy is imported."""
    for spec in (args.target, args.assistant):  # a path, not a hub id: it must be there
        if spec and missing_folder(spec):
            return f"could not load model {spec!r}: no such folder"
    for option, folder in (("--drafters", args.drafters), ("--joint", args.joint)):
        if folder and not os.path.isdir(os.path.expanduser(folder)):
            return f"{option} {folder}: no such folder"
    for pair in args.drafter:
        name, sep, source = pair.partition("=")
        if not sep or not name.strip() or not source.strip():
            return f"--drafter {pair!r}: write METHOD=HF_ID_OR_FOLDER, e.g. eagle3=./my-eagle3"
        if missing_folder(source.strip()):
            return f"--drafter {pair!r}: no such folder"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if problem := missing_folders(args):
        sys.exit(f"specviz: {problem}")
    host, port = os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), int(os.environ.get("GRADIO_SERVER_PORT", "7860"))
    with StartingPage(host, port) as page:  # answers at once; the app takes its address over when it is ready
        if os.environ.get("SPACE_ID"):
            page.stage("installing the packages a Space cannot install itself")
        install_space_packages()  # before the embedded target's package is looked up
        page.stage("importing torch, transformers and Gradio")
        from drafters import checkpoint_sources
        from specviz.apps.web.joint import load_joint
        from specviz.apps.web.layout import build_demo, launch
        from specviz.apps.web.state import load_state
        from specviz.apps.web.views import warm_up
        from specviz.core.errors import SpecvizError
        from specviz.core.load import EMBEDDED, converted, embedded_cache, embedded_folder

        try:
            if (args.target or EMBEDDED) == EMBEDDED and not converted(embedded_cache()):
                page.stage("converting the embedded GGUF to safetensors (once per machine)", expected_s=25)
                embedded_folder()
            state = load_state(args.target, args.dtype, args.device, args.assistant, warm_up, tune=args.tune,
                               drafters=args.drafters, stage=page.stage, checkpoints=checkpoint_sources(args.drafter),
                               methods=args.methods, engine=args.engine)
            if args.joint:
                page.stage(f"loading the jointly trained target of {args.joint}")
                state.joint = load_joint(state, args.joint)
                state.on_engine(warm_up, state.joint.state)
        except SpecvizError as error:
            sys.exit(f"specviz: {error}")
        page.stage("laying out the page")
        demo = build_demo(state)
    launch(demo, state.target.max_length)


if __name__ == "__main__":
    main()
