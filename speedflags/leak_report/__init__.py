"""The pytest plugin's leak report: what a test left changed, as data (``findings``), and its
summary section, JSON file and pytest-xdist merging (``collect``).

Layering: these modules sit below :mod:`speedflags.pytest_plugin` only; they may import
anything below it (speedflags' public names, :mod:`speedflags.errors`, pytest), and nothing
in speedflags imports them but the plugin.
"""
