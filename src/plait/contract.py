"""``contract``: turn a function that modifies a module in place into a composable API.

Every plait API (``checkpoint``, ``replicate``, ``fully_shard``) is written as a plain
function ``api(module, ...) -> module`` and decorated with ``@contract()``. The decorator
gives it four guarantees, which is what makes the APIs compose:

* **Per-API state.** ``api.state(module)`` returns the state object this API attached to
  ``module`` (``None`` if it was never applied there). An API applied to a list of modules
  in one call attaches one shared state object to each of them.
* **A registry.** Each module records, in order, the names of the APIs applied to it;
  ``contract.get_registry(module)`` returns that ordered mapping, or ``None`` when no API was
  applied to the module itself (its parents and children keep their own registries).
* **Apply once.** Applying the same API twice to a module raises an ``AssertionError``
  (the type torch raises, so existing ``except`` clauses keep working) naming the API.
* **Names are sacred.** An API may mutate a module, swap its class or even return another
  module object, but the fully-qualified names (FQNs) of parameters, buffers and submodules
  must be exactly the same, in the same order, afterwards. Checkpoints, optimizers and
  state dicts written for the unwrapped model therefore keep working.

If the decorated function raises, the module is left as it was: no state, no registry entry.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from torch import nn

__all__ = [
    "APIState",
    "ComposableAPI",
    "RegistryItem",
    "contract",
    "get_registry",
    "with_mixin",
]

# Keys in ``module.__dict__``; the dict travels with deepcopy and pickling like any attribute.
_STATES_KEY = "_plait_api_states"
_REGISTRY_KEY = "_plait_api_registry"


class APIState:
    """Default per-API state: an attribute bag the API fills in as it likes."""


class RegistryItem:
    """One application of an API. Modules that received the same call share one item.

    Two registries compare equal exactly when they list the same APIs *from the same
    calls*: registries of modules wrapped together are equal, separately wrapped ones not.
    """

    __slots__ = ("name", "state")

    def __init__(self, name: str, state: object) -> None:
        self.name = name
        self.state = state

    def __repr__(self) -> str:
        return f"RegistryItem({self.name!r})"


_P = ParamSpec("_P")
_S = TypeVar("_S", covariant=True)
_M = TypeVar("_M", bound=nn.Module | list[nn.Module])


class ComposableAPI(Protocol, Generic[_P, _S]):
    """What ``@contract()`` returns: the API itself plus ``.state(module)``."""

    __name__: str

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> Any: ...

    def state(self, module: nn.Module) -> _S: ...


def get_registry(module: nn.Module) -> OrderedDict[str, RegistryItem] | None:
    """The APIs applied to ``module`` itself, in order of application, or ``None``."""
    registry: OrderedDict[str, RegistryItem] | None = module.__dict__.get(_REGISTRY_KEY)
    return registry


#: torch's name for :func:`get_registry` (``torch.distributed._composable._get_registry``),
#: so code written for torch finds it after changing only the import.
_get_registry = get_registry


_MIXIN_CLASSES: dict[tuple[type, type], type] = {}


def with_mixin(module: nn.Module, mixin: type, prefix: str) -> None:
    """Make ``module`` an instance of a subclass of both ``mixin`` and its own class.

    The subclass (named ``prefix + ClassName``) is created once per pair and cached, so
    ``isinstance`` works for both and every wrapped module of a class shares one type.
    """
    cls = type(module)
    key = (mixin, cls)
    if key not in _MIXIN_CLASSES:
        _MIXIN_CLASSES[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    module.__class__ = _MIXIN_CLASSES[key]


def _root_modules(modules: nn.Module | Sequence[nn.Module], api_name: str) -> list[nn.Module]:
    """The modules of ``modules`` that are not inside another one of them, in order."""
    if isinstance(modules, nn.Module):
        return [modules]
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(
            f"{api_name} expects an nn.Module or a list of nn.Module as its first argument, "
            f"got {type(modules).__name__}"
        )
    if not modules:
        raise ValueError(f"{api_name} was given an empty list of modules")
    inside: set[int] = set()
    for m in modules:
        inside.update(id(sub) for sub in m.modules() if sub is not m)
    roots: list[nn.Module] = []
    for m in modules:
        if id(m) not in inside and all(m is not r for r in roots):
            roots.append(m)
    return roots


def _fqns(module: nn.Module) -> dict[str, list[str]]:
    return {
        "parameters": [name for name, _ in module.named_parameters()],
        "buffers": [name for name, _ in module.named_buffers()],
        "modules": [name for name, _ in module.named_modules()],
    }


def _check_fqns(api_name: str, before: dict[str, list[str]], after: dict[str, list[str]]) -> None:
    for kind, old in before.items():
        new = after[kind]
        if old == new:
            continue
        old_set, new_set = set(old), set(new)
        only_old = [n for n in old if n not in new_set]
        only_new = [n for n in new if n not in old_set]
        if only_old or only_new:
            detail = f"FQNs only in original: {only_old}\nFQNs only in new: {only_new}"
        else:
            detail = f"the order of FQNs changed.\nOriginal: {old}\nNew: {new}"
        raise RuntimeError(
            f"Checking {kind}: Composable distributed API implementations cannot modify FQNs. "
            f"{api_name} changed the names of {kind}:\n{detail}\n"
            "Fix: mutate the module in place (hooks, attributes, a subclass swap) instead of "
            "wrapping it in a new parent module."
        )


def _as_list(modules: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [modules] if isinstance(modules, nn.Module) else list(modules)


def _forget(module: nn.Module, func: object, name: str) -> None:
    """Undo the registration of a failed application, leaving ``module`` as it was."""
    for key, entry in ((_STATES_KEY, func), (_REGISTRY_KEY, name)):
        table = module.__dict__.get(key)
        if table is not None:
            table.pop(entry, None)
            if not table:
                del module.__dict__[key]


class _Contract:
    """``contract(state_cls=APIState)``: the decorator factory; see the module docstring.

    It is an object rather than a function only so that ``plait.contract.get_registry``
    resolves both when ``plait.contract`` means this decorator and when it means the module.
    """

    get_registry = staticmethod(get_registry)
    _get_registry = get_registry  # torch's name; the same staticmethod

    @overload
    def __call__(
        self,
    ) -> Callable[
        [Callable[Concatenate[_M, _P], Any]], ComposableAPI[Concatenate[_M, _P], Any]
    ]: ...

    @overload
    def __call__(
        self, state_cls: Callable[[], _S]
    ) -> Callable[[Callable[Concatenate[_M, _P], Any]], ComposableAPI[Concatenate[_M, _P], _S]]: ...

    def __call__(
        self, state_cls: Callable[[], Any] = APIState
    ) -> Callable[[Callable[Concatenate[_M, _P], Any]], ComposableAPI[Concatenate[_M, _P], Any]]:
        def decorate(
            func: Callable[Concatenate[_M, _P], Any],
        ) -> ComposableAPI[Concatenate[_M, _P], Any]:
            return _make_api(func, state_cls)

        return decorate


def _make_api(
    func: Callable[Concatenate[_M, _P], Any], state_cls: Callable[[], Any]
) -> ComposableAPI[Concatenate[_M, _P], Any]:
    name = func.__name__

    @functools.wraps(func)
    def api(module: _M, /, *args: _P.args, **kwargs: _P.kwargs) -> Any:
        roots = _root_modules(module, name)
        for m in roots:
            registry = get_registry(m)
            if registry is not None and name in registry:
                raise AssertionError(
                    "Each distinct composable distributed API can only be applied to a module "
                    f"once. {name} has already been applied to the following module:\n{m}"
                )
        # Attach state before calling ``func``: the API body reads ``api.state(module)``.
        state = state_cls()
        item = RegistryItem(name, state)
        before = [_fqns(m) for m in roots]
        for m in roots:
            m.__dict__.setdefault(_STATES_KEY, {})[func] = state
            m.__dict__.setdefault(_REGISTRY_KEY, OrderedDict())[name] = item
        try:
            result = func(module, *args, **kwargs)
            updated = _root_modules(module if result is None else _as_list(result), name)
            if len(updated) != len(roots):
                raise RuntimeError(
                    f"{name} must return as many modules as it was given: "
                    f"got {len(roots)}, returned {len(updated)}"
                )
            for old_names, new_module in zip(before, updated, strict=True):
                _check_fqns(name, old_names, _fqns(new_module))
        except BaseException:
            for m in roots:
                _forget(m, func, name)
            raise
        return module if result is None else result

    def state(module: nn.Module) -> Any:
        """The state ``api`` attached to ``module``, or ``None`` if it was not applied."""
        return module.__dict__.get(_STATES_KEY, {}).get(func)

    api.state = state  # type: ignore[attr-defined]
    return api  # type: ignore[return-value]


contract = _Contract()
