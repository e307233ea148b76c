"""The checkpoint conversion registry: class names and ``model_type`` strings → conversion mappings.

A *conversion mapping* is an ordered list of :class:`~surgery.transforms.WeightTransform`
prototypes registered under a key, which is either a module class name (``"DetrModel"``) or a
``config.model_type`` (``"mixtral"``). A key may instead be an *alias* naming another key
(``"qwen3_moe" -> "qwen2_moe"``); alias chains are followed at lookup. Lookups hand out fresh
copies, so the stored prototypes are never mutated by a load.

Catalogs. The engine imports no model family: the first registry access loads every entry point
of the ``surgery.catalogs`` group (the built-in one is ``specs:register_catalog``) and calls it.
Everything registered while a catalog runs is a *catalog entry* (provenance
``"catalog:<entry point name>"``); everything else is a *user entry* (provenance ``"user"``).
A catalog declares which code its entries were written for with
:func:`register_catalog_modules`; resolution applies a catalog entry only to classes whose
``__module__`` lies under one of those prefixes, whereas user entries apply to any class.

Writing a catalog (a function taking no arguments, declared as an entry point)::

    # pyproject.toml:  [project.entry-points."surgery.catalogs"]  acme = "acme_specs:register_catalog"
    def register_catalog() -> None:
        register_catalog_modules("acme.models")
        register_checkpoint_conversion_mapping("acme", [WeightRenaming(r"\\.attn\\.", ".self_attn.")])
        register_checkpoint_conversion_mapping("acme_v2", "acme")          # alias

Testing. :func:`registry_snapshot` restores the whole registry on exit (``clear=True`` starts
from an empty registry without loading any catalog); :func:`registering_catalog` marks the
registrations made inside it as entries of a named catalog, exactly as if an entry point ran::

    with registry_snapshot(clear=True), registering_catalog("tests"):
        register_catalog_modules(__name__)
        register_checkpoint_conversion_mapping("mixtral", [...])
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from .errors import RegistryError
from .patterns import lazy_compilation
from .transforms import WeightTransform

__all__ = [
    "CATALOG_ENTRY_POINT_GROUP",
    "RegistryEntry",
    "catalog_modules",
    "checkpoint_conversion_entry",
    "current_catalog",
    "entry_applies_to",
    "find_checkpoint_conversion_mapping",
    "get_checkpoint_conversion_mapping",
    "is_known_to_catalog",
    "list_checkpoint_conversion_keys",
    "load_catalogs",
    "lookup_entry",
    "register_catalog_modules",
    "register_checkpoint_conversion_mapping",
    "registered_keys",
    "registering_catalog",
    "registry_snapshot",
]

CATALOG_ENTRY_POINT_GROUP = "surgery.catalogs"
"""The entry-point group the registry loads catalogs from."""

USER = "user"
_BUILTIN_CATALOG = "builtin"
_MAX_LISTED_KEYS = 25


@dataclass(frozen=True, slots=True)
class RegistryEntry:
    """One registered key.

    Attributes:
        key: the class name or ``model_type`` it is registered under.
        transforms: the stored prototypes (empty for an alias).
        alias: the key this one stands for, or ``None``.
        provenance: ``"user"`` or ``"catalog:<name>"``.
    """

    key: str
    transforms: tuple[WeightTransform, ...]
    alias: str | None
    provenance: str

    @property
    def catalog(self) -> str | None:
        """The catalog that registered this entry, or ``None`` for a user entry."""
        return self.provenance.split(":", 1)[1] if self.provenance.startswith("catalog:") else None

    def describe(self) -> str:
        what = (
            f"alias of {self.alias!r}" if self.alias is not None else f"{len(self.transforms)} transform(s)"
        )
        return f"{self.key!r} ({what}, registered by {self.provenance})"


@dataclass
class _State:
    entries: dict[str, RegistryEntry]
    modules: dict[str, tuple[str, ...]]  # catalog name -> module prefixes
    loaded: bool


class _Registry:
    """Process-wide registry state; every access goes through one re-entrant lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.state = _State({}, {}, False)
        self.loading = False
        self._local = threading.local()

    # ------------------------------------------------------------------ catalog context
    @property
    def current_catalog(self) -> str | None:
        stack = getattr(self._local, "catalogs", None)
        return stack[-1] if stack else None

    @contextmanager
    def catalog(self, name: str) -> Iterator[None]:
        # Per thread: a registration from another thread while a catalog runs stays a user entry.
        stack = self._local.__dict__.setdefault("catalogs", [])
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()

    # ------------------------------------------------------------------ loading
    def ensure_loaded(self) -> None:
        if self.state.loaded:
            return
        with self.lock:  # other threads wait here until the catalogs are in
            if self.state.loaded or self.loading:
                return  # ``loading``: a catalog looking something up while it registers
            before = _State(dict(self.state.entries), dict(self.state.modules), False)
            self.loading = True
            try:
                with lazy_compilation():  # most catalog patterns never meet a given model
                    for ep in _catalog_entry_points():
                        self._run_entry_point(ep)
            except BaseException:
                self.state = before  # all or nothing: the next access retries (and fails) loudly
                raise
            finally:
                self.loading = False
            self.state.loaded = True

    def _run_entry_point(self, ep: EntryPoint) -> None:
        where = f"catalog entry point {ep.name!r} ({ep.value}) in group {CATALOG_ENTRY_POINT_GROUP!r}"
        try:
            func = ep.load()
        except Exception as exc:
            raise RegistryError(
                f"The {where} could not be imported: {type(exc).__name__}: {exc}. "
                "Fix the package that declares it, or uninstall it."
            ) from exc
        if not callable(func):
            raise RegistryError(
                f"The {where} is {func!r}, not a function; point it at a function taking no arguments."
            )
        with self.catalog(ep.name):
            try:
                func()
            except RegistryError as exc:
                raise RegistryError(f"The {where} failed while registering: {exc}") from exc
            except Exception as exc:
                raise RegistryError(
                    f"The {where} raised {type(exc).__name__}: {exc}. Fix the catalog, or uninstall the "
                    "package that declares it."
                ) from exc
            self.check_catalog_declared(ep.name, where)

    def check_catalog_declared(self, name: str, where: str) -> None:
        provenance = f"catalog:{name}"
        owned = [e.key for e in self.state.entries.values() if e.provenance == provenance]
        if owned and not self.state.modules.get(name):
            raise RegistryError(
                f"The {where} registered conversion mappings ({', '.join(map(repr, owned[:3]))}"
                f"{', ...' if len(owned) > 3 else ''}) but declared no module prefixes, so they would "
                "apply to no class. Call register_catalog_modules('your_package', ...) in the catalog."
            )


_REGISTRY = _Registry()


def _catalog_entry_points() -> list[EntryPoint]:
    by_name: dict[str, EntryPoint] = {}
    for ep in entry_points(group=CATALOG_ENTRY_POINT_GROUP):
        other = by_name.setdefault(ep.name, ep)
        if other.value != ep.value:  # the same pair twice is fine (editable + regular install)
            raise RegistryError(
                f"Two {CATALOG_ENTRY_POINT_GROUP!r} entry points are both named {ep.name!r}: {other.value!r} and "
                f"{ep.value!r}. Catalog names must be unique; rename one in its package metadata."
            )
    found = list(by_name.values())
    # The built-in catalog first, then the others by name: collisions are reported deterministically.
    return sorted(found, key=lambda ep: (ep.name != _BUILTIN_CATALOG, ep.name, ep.value))


# ---------------------------------------------------------------------- validation
def _check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str) or not key or key != key.strip():
        raise RegistryError(
            f"A conversion mapping {what} must be a non-empty class name or model_type string without "
            f"surrounding spaces, got {key!r}."
        )
    return key


def _check_transforms(key: str, value: object) -> tuple[WeightTransform, ...]:
    if isinstance(value, WeightTransform):
        raise RegistryError(
            f"register_checkpoint_conversion_mapping({key!r}, ...) got a single {value!r}; wrap it in a list."
        )
    if not isinstance(value, (list, tuple)):
        raise RegistryError(
            f"register_checkpoint_conversion_mapping({key!r}, ...) needs a list of WeightTransform or an alias "
            f"string, got {type(value).__name__}: {value!r}."
        )
    for i, item in enumerate(value):
        if not isinstance(item, WeightTransform):
            raise RegistryError(
                f"register_checkpoint_conversion_mapping({key!r}, ...): item {i} is {item!r} "
                f"({type(item).__name__}), not a WeightTransform (WeightRenaming, PrefixChange, WeightConverter)."
            )
        if item.scope_prefix is not None:
            raise RegistryError(
                f"register_checkpoint_conversion_mapping({key!r}, ...): item {i} {item!r} already has a "
                "scope_prefix. Register unscoped prototypes; resolution scopes each copy to its sub-model."
            )
    return tuple(value)


# ---------------------------------------------------------------------- registration
def register_checkpoint_conversion_mapping(
    key: str,
    transforms_or_alias: Sequence[WeightTransform] | str,
    overwrite: bool = False,
) -> None:
    r"""Register a conversion mapping (or an alias) under a class name or ``model_type``.

    Registering a key that exists raises unless ``overwrite=True``. Called while a catalog loads
    (or inside :func:`registering_catalog`), the entry belongs to that catalog; otherwise it is a
    user entry, which applies to any class, custom code included.

    Args:
        key: a module class name (``"DetrModel"``) or a ``config.model_type`` (``"mixtral"``).
            Class names win over ``model_type`` at resolution.
        transforms_or_alias: a list of :class:`~surgery.transforms.WeightTransform` prototypes
            (unscoped; stored as given, handed out as copies), or the key of another entry.
        overwrite: replace an existing entry instead of failing.

    Raises:
        RegistryError: the key or an item is invalid, or the key is taken and ``overwrite`` is false
            (the message names both the existing and the new entry).

    Example:
        >>> from surgery import WeightRenaming
        >>> with registry_snapshot(clear=True):
        ...     register_checkpoint_conversion_mapping("toy", [WeightRenaming(r"\.gamma$", ".weight")])
        ...     register_checkpoint_conversion_mapping("toy_v2", "toy")
        ...     get_checkpoint_conversion_mapping("toy_v2")
        [WeightRenaming('\\.gamma$' -> '.weight')]
    """
    _check_key(key)
    if not isinstance(overwrite, bool):
        raise RegistryError(f"overwrite must be True or False, got {overwrite!r}.")
    if isinstance(transforms_or_alias, str):
        alias: str | None = _check_key(transforms_or_alias, "alias target")
        if alias == key:
            raise RegistryError(
                f"{key!r} cannot be an alias of itself; give a list of transforms or another key."
            )
        transforms: tuple[WeightTransform, ...] = ()
    else:
        alias = None
        transforms = _check_transforms(key, transforms_or_alias)
    reg = _REGISTRY
    reg.ensure_loaded()
    with reg.lock:
        catalog = reg.current_catalog
        entry = RegistryEntry(key, transforms, alias, f"catalog:{catalog}" if catalog is not None else USER)
        old = reg.state.entries.get(key)
        if old is not None and not overwrite:
            raise RegistryError(
                f"A conversion mapping is already registered for {old.describe()}; the new entry "
                f"{entry.describe()} collides with it. Pass overwrite=True to replace it, or use another key."
            )
        reg.state.entries[key] = entry


def register_catalog_modules(*module_prefixes: str) -> None:
    """Declare which code the current catalog's entries were written for.

    A class is *known to the catalog* when its ``__module__`` equals one of the prefixes or starts
    with a prefix followed by a dot (``"transformers"`` covers ``transformers.models.llama``).
    Catalog entries apply only to known classes; call this from a catalog function (or inside
    :func:`registering_catalog`). Repeated calls add prefixes.

    Args:
        *module_prefixes: dotted module names, e.g. ``"transformers"``, ``"surgery.examples"``.

    Raises:
        RegistryError: called outside a catalog, or a prefix is not a dotted module name.
    """
    reg = _REGISTRY
    catalog = reg.current_catalog
    if catalog is None:
        raise RegistryError(
            f"register_catalog_modules{module_prefixes!r} was called outside a catalog. Call it from the "
            f"function your {CATALOG_ENTRY_POINT_GROUP!r} entry point names, or inside "
            "registering_catalog(name). User registrations need no declaration: they apply to any class."
        )
    if not module_prefixes:
        raise RegistryError(
            "register_catalog_modules() needs at least one module prefix, e.g. 'transformers'."
        )
    for p in module_prefixes:
        if not isinstance(p, str) or not p or p.startswith(".") or p.endswith(".") or " " in p:
            raise RegistryError(
                f"register_catalog_modules: {p!r} is not a dotted module name like 'transformers'."
            )
    with reg.lock:
        old = reg.state.modules.get(catalog, ())
        reg.state.modules[catalog] = old + tuple(p for p in module_prefixes if p not in old)


# ---------------------------------------------------------------------- lookup
def _resolve_chain(key: str) -> tuple[RegistryEntry, RegistryEntry] | None:
    """``(first entry, entry holding the transforms)`` for ``key``; ``None`` when not registered."""
    entries = _REGISTRY.state.entries
    first = entries.get(key)
    if first is None:
        return None
    chain = [key]
    entry = first
    while entry.alias is not None:
        target = entries.get(entry.alias)
        if entry.alias in chain:
            raise RegistryError(
                f"Alias cycle in the conversion registry: {' -> '.join(map(repr, [*chain, entry.alias]))}. "
                "Make one of these keys a list of transforms."
            )
        if target is None:
            raise RegistryError(
                f"{entry.describe()} points at {entry.alias!r}, which is not registered"
                f"{_suggest(entry.alias)}. Register {entry.alias!r} or fix the alias."
            )
        chain.append(entry.alias)
        entry = target
    return first, entry


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, list(_REGISTRY.state.entries), n=3)
    return f" (closest: {', '.join(map(repr, close))})" if close else ""


def lookup_entry(key: str) -> tuple[RegistryEntry, list[WeightTransform]] | None:
    """``(the entry registered under key, fresh copies of its resolved transforms)`` or ``None``.

    Raises:
        RegistryError: the key is an alias whose chain has a cycle or ends at an unknown key.
    """
    reg = _REGISTRY
    reg.ensure_loaded()
    with reg.lock:
        found = _resolve_chain(key)
        if found is None:
            return None
        first, target = found
        return first, [t.copy() for t in target.transforms]


def find_checkpoint_conversion_mapping(key: str) -> list[WeightTransform] | None:
    """Fresh copies of the mapping registered under ``key`` (aliases followed), or ``None``.

    Raises:
        RegistryError: ``key`` is an alias whose chain has a cycle or ends at an unknown key.
    """
    found = lookup_entry(key)
    return None if found is None else found[1]


def get_checkpoint_conversion_mapping(key: str) -> list[WeightTransform]:
    """Fresh copies of the mapping registered under ``key`` (aliases followed).

    Args:
        key: a class name or ``model_type``.

    Returns:
        New transform objects each call: using them never touches the registered prototypes.

    Raises:
        RegistryError: ``key`` is not registered (the message lists known keys and the closest
            match), or its alias chain has a cycle or ends at an unknown key.

    Example:
        >>> from surgery import WeightRenaming
        >>> with registry_snapshot(clear=True):
        ...     register_checkpoint_conversion_mapping("toy", [WeightRenaming("a", "b")])
        ...     get_checkpoint_conversion_mapping("toy")[0] is get_checkpoint_conversion_mapping("toy")[0]
        False
    """
    found = lookup_entry(key)
    if found is not None:
        return found[1]
    with _REGISTRY.lock:
        known = sorted(_REGISTRY.state.entries)
        hint = _suggest(key)
    listed = ", ".join(map(repr, known[:_MAX_LISTED_KEYS]))
    more = f", ... and {len(known) - _MAX_LISTED_KEYS} more" if len(known) > _MAX_LISTED_KEYS else ""
    raise RegistryError(
        f"No checkpoint conversion mapping is registered for {key!r}{hint}. Known keys: "
        f"{listed or 'none'}{more}. Register one with register_checkpoint_conversion_mapping({key!r}, [...])."
    )


def checkpoint_conversion_entry(key: str) -> RegistryEntry | None:
    """The entry registered under ``key`` itself (an alias is not followed), or ``None``."""
    reg = _REGISTRY
    reg.ensure_loaded()
    with reg.lock:
        return reg.state.entries.get(key)


def list_checkpoint_conversion_keys() -> list[str]:
    """Every registered key (mappings and aliases), sorted."""
    reg = _REGISTRY
    reg.ensure_loaded()
    with reg.lock:
        return sorted(reg.state.entries)


def registered_keys() -> frozenset[str]:
    """Every registered key as a set (cheap membership tests for graph building)."""
    reg = _REGISTRY
    reg.ensure_loaded()
    with reg.lock:
        return frozenset(reg.state.entries)


# ---------------------------------------------------------------------- custom-code filter
def catalog_modules(catalog: str | None = None) -> tuple[str, ...]:
    """Module prefixes declared by ``catalog`` (by entry-point name), or by every catalog."""
    reg = _REGISTRY
    reg.ensure_loaded()
    with reg.lock:
        if catalog is not None:
            return reg.state.modules.get(catalog, ())
        return tuple(dict.fromkeys(p for ps in reg.state.modules.values() for p in ps))


def _under(module_name: str, prefixes: Sequence[str]) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in prefixes)


def is_known_to_catalog(cls: type, catalog: str | None = None) -> bool:
    """Whether ``cls.__module__`` lies under a prefix declared by ``catalog`` (or by any catalog)."""
    return _under(getattr(cls, "__module__", "") or "", catalog_modules(catalog))


def entry_applies_to(entry: RegistryEntry, cls: type) -> bool:
    """The custom-code filter: a user entry applies to any class, a catalog entry to known classes."""
    catalog = entry.catalog
    return catalog is None or is_known_to_catalog(cls, catalog)


# ---------------------------------------------------------------------- catalogs and testing
def load_catalogs() -> None:
    """Load every ``surgery.catalogs`` entry point now (otherwise done on the first access).

    Idempotent and thread-safe: catalogs run once per process (or per :func:`registry_snapshot`
    with ``clear=False`` that restored an unloaded state).

    Raises:
        RegistryError: a catalog failed to import or raised; the message names the entry point.
            Nothing it registered is kept, and the next access tries again.
    """
    _REGISTRY.ensure_loaded()


def current_catalog() -> str | None:
    """The catalog whose registrations are running in this thread, or ``None`` (a user call).

    Other registries (fusions) use it to tell catalog entries from user entries.
    """
    return _REGISTRY.current_catalog


@contextmanager
def registering_catalog(name: str) -> Iterator[None]:
    """Mark registrations made inside as entries of catalog ``name``, as if its entry point ran.

    The entry-point loader uses this for every catalog; tests use it to register catalog entries
    and declare :func:`register_catalog_modules` for their own module.

    Args:
        name: the catalog name; entries get provenance ``"catalog:<name>"``.

    Raises:
        RegistryError: on exit, when the catalog registered mappings but declared no module prefixes.
    """
    _check_key(name, "catalog name")
    reg = _REGISTRY
    reg.ensure_loaded()
    with reg.catalog(name):
        yield
        reg.check_catalog_declared(name, f"catalog {name!r}")


@contextmanager
def registry_snapshot(*, clear: bool = False, reload_catalogs: bool = False) -> Iterator[None]:
    """Restore the registry (entries, catalog modules, loaded flag) on exit.

    Args:
        clear: start from an empty registry in which the catalogs count as loaded, so nothing the
            installed catalogs register can collide with what the block registers.
        reload_catalogs: with ``clear``, leave the catalogs unloaded instead: the next access
            loads every installed catalog again (tests of the catalogs themselves).

    Raises:
        RegistryError: ``reload_catalogs`` without ``clear``.

    Example:
        >>> with registry_snapshot(clear=True):
        ...     list_checkpoint_conversion_keys()
        []
    """
    if reload_catalogs and not clear:
        raise RegistryError(
            "registry_snapshot(reload_catalogs=True) needs clear=True: catalogs load into an empty registry."
        )
    reg = _REGISTRY
    if not clear:
        reg.ensure_loaded()
    with reg.lock:
        saved = _State(dict(reg.state.entries), dict(reg.state.modules), reg.state.loaded)
        if clear:
            reg.state = _State({}, {}, not reload_catalogs)
    try:
        yield
    finally:
        with reg.lock:
            reg.state = saved
