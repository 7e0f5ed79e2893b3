"""specviz app entry point.

The Gradio comparison UI is not built yet (it is the app issue). Until then this file says so and
points at the command line, which runs the same engine: ``python -m specviz generate --prompt ...``.
"""

import sys

if __name__ == "__main__":
    sys.exit("specviz: the Gradio app is not built yet; use `python -m specviz generate --prompt \"...\"` "
             "(see README).")
