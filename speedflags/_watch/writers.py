"""Who wrote each current value, as a running :func:`speedflags.watch` knows it (for the
report, and for users asking the same)."""

from __future__ import annotations

import threading

from . import watcher as _watcher_module
from .setters import flatten

__all__ = ["last_writers", "watching"]


def watching() -> bool:
    """Whether a :func:`speedflags.watch` is running in this process (``SPEEDFLAGS_WATCH=1``
    starts one at import).

    Example:
        >>> import speedflags
        >>> from speedflags._watch.writers import watching
        >>> with speedflags.watch():
        ...     watching()
        True
    """
    watcher = _watcher_module._WATCHER
    return watcher is not None and watcher.count > 0


def last_writers() -> dict[str, str]:
    """Snapshot key (``"tf32.torch.backends.fp32_precision"``) -> who set its current value.

    Only values still current, written through Python while a watch was on; autocast keys
    and thread-scope guarded settings for the calling thread.

    Example:
        >>> import torch, speedflags
        >>> from speedflags._watch.writers import last_writers
        >>> with speedflags.watch():
        ...     torch.backends.cudnn.benchmark = True
        ...     print(last_writers()["cudnn_benchmark"].split(" by ")[0])
        ...     torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.benchmark set to True
    """
    watcher = _watcher_module._WATCHER
    if watcher is None or watcher.count == 0:
        return {}
    out: dict[str, str] = {}
    tid = threading.get_ident()
    for domain in watcher.domains:
        for _, prefix, lever in domain.views:
            for key, value in flatten(prefix, lever.describe(domain.lever.read()), {}).items():
                known = watcher.by_getter.get((key, tid if domain.thread else None))
                if known is not None and known[1] == value:
                    out[key] = known[0].sentence()
    return out
