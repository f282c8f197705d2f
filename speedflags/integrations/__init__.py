"""Trainer callbacks: speedflags levers per phase of a Lightning or Hugging Face training run.

Each integration lives in its own module and is imported only when used, so ``import
speedflags`` (and this package) never imports Lightning or transformers:

- :mod:`speedflags.integrations.lightning`: ``SpeedFlagsCallback(train=..., validate=...,
  test=..., predict=..., schedule=...)`` for ``lightning.pytorch`` and ``pytorch_lightning``
  (``pip install '.[lightning]'`` in a checkout of speedflags).
- :mod:`speedflags.integrations.transformers`: ``SpeedFlagsCallback(train=...,
  evaluate=...)``, a ``transformers.TrainerCallback`` (``pip install '.[transformers]'``).

speedflags installs from a checkout of its repository until it is published; then
``pip install 'speedflags[lightning]'`` will do.

Both take, per phase, a dict of :func:`speedflags.fast_math` keyword arguments, validated
when the callback is built, and apply them through the ledger for that phase only: every
flag comes back when the phase ends, also when it ends with an exception.

May import: ``fast_math``, ``status``, the ledger, the levers' registry and the base modules;
Lightning and transformers only inside the module that adapts to them, never at
``import speedflags``.
"""
