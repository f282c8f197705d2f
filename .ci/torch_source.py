"""Say which torch a leg installed and from where: `torch_source.py REPORT.json`.

REPORT.json is the `pip install --report` that `make setup` writes when it installs the pinned
torch. "disk" means a wheel on this machine (a `file:` link or a local index); "registry"
means it was downloaded. Prints one line; exit 1 if the report names no torch.
"""

from __future__ import annotations

import json
import sys
from typing import Mapping


def describe(report: Mapping[str, object]) -> str:
    installs = report.get("install", [])
    for item in installs if isinstance(installs, list) else []:
        metadata = item.get("metadata", {})
        if metadata.get("name", "").lower() != "torch":
            continue
        url = item.get("download_info", {}).get("url", "")
        source = "disk" if url.startswith("file:") else "registry" if url else "unknown"
        return f"torch {metadata.get('version', '?')} installed from {source}: {url or '?'}"
    raise LookupError("the pip report installs no torch")


def main(path: str) -> None:
    with open(path, encoding="utf-8") as fh:
        report = json.load(fh)
    try:
        print(describe(report))
    except LookupError as exc:
        print(f"torch_source: {path}: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
