"""What the command lines (``speedflags bench``, ``tune``, ``verify``, ``report``) share.

- :mod:`.options`: every option checked in one place, before a user's file is imported or
  anything is measured.

May import: the tools (:mod:`speedflags.bench`, :mod:`speedflags.tune`,
:mod:`speedflags.verify`) for what their options accept, and everything below them. Only
the entry point (``speedflags.__main__``) imports it, so no tool depends on it.
"""
