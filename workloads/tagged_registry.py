"""A registry of tagged pydantic models: the one mechanism behind ``@history_policy`` and
``@model_routing_policy`` (a spec entry chosen by its ``kind``).

``register(kind)`` gives the decorated class its ``kind: Literal[kind]`` tag (a subclass made with
``create_model``, so ``isinstance`` checks against the module's name hold) and records it; :attr:`annotated`
is the spec type that accepts any registered model. The union is validated through a lazily built
``TypeAdapter`` rather than a static ``Union[...]`` so that a kind registered after the spec models were
imported (a plug-in, a test) is accepted without rebuilding them, and pydantic's own ``union_tag_invalid``
errors (and their locations) are kept. Why in workloads: it is the lowest layer that needs it (history
policies), and the cache model's routing policies sit above it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Generic, Literal, TypeVar, Union

from pydantic import BaseModel, Field, PlainValidator, SerializeAsAny, TypeAdapter, create_model

M = TypeVar("M", bound=BaseModel)
_C = TypeVar("_C", bound=type)


class TaggedRegistry(Generic[M]):
    """Spec tag → model, for models of ``base`` (which declares ``kind: str``); ``what`` names an entry in
    error messages ("history policy")."""

    def __init__(self, base: type[M], what: str) -> None:
        self.base, self.what = base, what
        self._models: dict[str, type[M]] = {}
        self._adapter: TypeAdapter | None = None
        self.annotated = Annotated[SerializeAsAny[base], PlainValidator(self.validate)]  # type: ignore[valid-type]

    def register(self, kind: str) -> Callable[[_C], _C]:
        """Register a model under the spec tag ``kind``; returns the tagged model."""

        def register(cls: _C) -> _C:
            if kind in self._models:
                raise ValueError(f"{self.what} {kind!r} is already registered by {self._models[kind].__name__}")
            tagged = create_model(cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__,
                                  kind=(Literal[kind], Field(default=kind)))  # type: ignore[call-overload]
            tagged.__qualname__ = cls.__qualname__
            self._models[kind] = tagged
            self._adapter = None
            return tagged  # type: ignore[return-value]

        return register

    def kinds(self) -> tuple[str, ...]:
        """The registered spec tags, in registration order (the order error messages list them in)."""
        return tuple(self._models)

    def models(self) -> dict[str, type[M]]:
        """Spec tag → model."""
        return dict(self._models)

    def validate(self, value: Any) -> M:
        """A registered model from its spec entry (a model instance of a registered kind passes as it is)."""
        if isinstance(value, self.base) and self._models.get(value.kind) is type(value):  # type: ignore[attr-defined]
            return value
        if self._adapter is None:
            members = tuple(self._models.values())
            self._adapter = TypeAdapter(Annotated[Union[members], Field(discriminator="kind")])  # type: ignore[valid-type]  # noqa: UP007
        return self._adapter.validate_python(value)
