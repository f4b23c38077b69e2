"""A name -> function registry: the extension point for estimators, losses, rewards and tasks.

A `Registry` is a dict (so `name in REG`, `sorted(REG)` work) with a decorator that refuses to
register a name twice and a lookup whose error names the unknown entry and lists the known ones.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register `fn` under `name` (ValueError if the name is taken)."""

        def deco(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            return fn

        return deco

    def lookup(self, name: str) -> Callable:
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {sorted(self)}")
        return self[name]
