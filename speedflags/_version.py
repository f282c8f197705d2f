"""The package's version, and how to install it and its optional extras.

speedflags is not on a package index yet: it installs from a checkout of its repository
(``pip install .`` in it, ``pip install '.[plot]'`` with an extra). Every message that says
how to get an extra says it in that form, and names the index form only as what it will be
once speedflags is published.
"""

__version__ = "0.1.0"


def install_hint(extra: str) -> str:
    """The ``pip install`` line of the optional extra ``extra``, in a form that works now.

    Example:
        >>> from speedflags._version import install_hint
        >>> print(install_hint("plot"))
        pip install '.[plot]' in a checkout of speedflags (once it is published: pip install 'speedflags[plot]')
    """  # noqa: E501 - a doctest's expected line
    return (
        f"pip install '.[{extra}]' in a checkout of speedflags "
        f"(once it is published: pip install 'speedflags[{extra}]')"
    )
