"""Do two bench results files decode the same? Same τ, same steps and the same accepted length at every step,
per prompt and method (speeds are not compared: they belong to their runs).

    python3 scripts/compare_benches.py BEFORE.json AFTER.json    # exit 1 when any (prompt, method) differs
"""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path


def load(path: str) -> dict:
    raw = Path(path).read_bytes()
    return json.loads(lzma.decompress(raw) if path.endswith(".xz") else raw)


def decodes(result: dict) -> dict[tuple[str, str], tuple]:
    return {(row["id"], label): (run["accepted_per_step"], run["steps"], run["identical_to_ar"])
            for row in result["per_prompt"] for label, run in row["methods"].items()}


def main() -> int:
    before, after = load(sys.argv[1]), load(sys.argv[2])
    a, b = decodes(before), decodes(after)
    common = sorted(set(a) & set(b))
    differ = [key for key in common if a[key] != b[key]]
    print(f"{len(common)} (prompt, method) pairs over {len({k[0] for k in common})} prompts; {len(differ)} differ")
    for key in differ[:10]:
        print("  differs:", key)
    for label in before["methods"]:
        if label in after["methods"]:
            x, y = before["methods"][label], after["methods"][label]
            print(f"{label:28} τ {x['tau']:.4f} -> {y['tau']:.4f}   identical to AR {x['identical_to_ar']} -> "
                  f"{y['identical_to_ar']}")
    return 1 if differ or not common else 0


if __name__ == "__main__":
    sys.exit(main())
