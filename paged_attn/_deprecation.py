"""Old names that keep working, with a DeprecationWarning (``warn_renamed``): keyword arguments
(``renamed_keywords``) and read-only attributes (``renamed_attributes``), as decorators."""

from __future__ import annotations

import functools
import warnings


def warn_renamed(old: str, new: str, stacklevel: int = 2) -> str:
    """Warns that ``old`` is a deprecated name of ``new`` (``stacklevel`` as ``warnings.warn``'s, counted from the
    caller of this function); returns the message."""
    message = f"{old} is deprecated; use {new}"
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
    return message


def renamed_keywords(**renames: str):
    """Decorates a function so that each keyword ``old=new`` of ``renames`` is still accepted as ``new``, with a
    DeprecationWarning; giving both is a TypeError."""
    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{function.__qualname__}() got {new!r} and its deprecated name {old!r}")
                    warn_renamed(old, new)
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)
        return wrapper
    return decorate


def renamed_attributes(**renames: str):
    """Decorates a class with a read-only property ``old`` for each ``old=new`` of ``renames``: ``new``'s value, with
    a DeprecationWarning."""
    def decorate(cls):
        for old, new in renames.items():
            def get(self, old=old, new=new):
                warn_renamed(old, new)
                return getattr(self, new)
            setattr(cls, old, property(get, doc=f"Deprecated name of ``{new}``."))
        return cls
    return decorate
