"""The benchmarks' one way to report: the results as JSON on stdout, and in ``$OUT/<name>.json``
when ``$OUT`` is set (the device machine sends that folder back)."""

from __future__ import annotations

import json
import os


def report(res: dict, name: str) -> None:
    text = json.dumps(res, indent=2)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
            f.write(text)
