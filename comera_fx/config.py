"""Configuration as validated, frozen dataclasses.

Config is data; the code acting on it lives in ``passes/``. Strings are accepted at the edge (``init="svd"``,
``linear_format="tt"``) and turned into enums in ``__post_init__``; every invalid value raises ``ValueError`` naming
the field and the allowed range.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .tt.layout import TTFormat


class Allocation(str, enum.Enum):
    """How ``TensorizeConfig.size_target`` is split over the layers: one ``max_rank`` for all (UNIFORM), or ranks
    per layer and per bond, greedily where the (activation-weighted) energy per parameter is largest (ENERGY)."""

    UNIFORM = "uniform"
    ENERGY = "energy"


class Init(str, enum.Enum):
    """How the cores start: TT-SVD of the current weights, or random with the dense layer's init variance."""

    SVD = "svd"
    RANDOM = "random"


# ------------------------------------------------------------------------------------------- renamed spellings


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """One ``DeprecationWarning`` for a spelling kept for a release: it names the spelling to use instead."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keywords(
    given: Mapping[str, Any], renames: Mapping[str, str], owner: str, *, stacklevel: int = 4
) -> dict[str, Any]:
    """``given`` with each old keyword of ``renames`` (old -> new) moved to its new name, warning once per old
    keyword; both spellings at once is refused (which one would win is not obvious)."""
    out = dict(given)
    for old, new in renames.items():
        if old not in out:
            continue
        if new in out:
            raise TypeError(f"{owner}: pass {new}= only ({old}= is its deprecated spelling); got both")
        warn_renamed(f"{owner}({old}=...)", f"{new}=", stacklevel=stacklevel)
        out[new] = out.pop(old)
    return out


def accepts_renamed(renames: Mapping[str, str]):
    """Class decorator: the dataclass's constructor also takes the old keywords of ``renames`` (old -> new) for a
    release, with a warning."""

    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **renamed_keywords(kwargs, renames, cls.__name__))

        cls.__init__ = __init__
        return cls

    return decorate


def _coerce_enum(owner: str, name: str, value: Any, enum_type: type[enum.Enum]) -> enum.Enum:
    try:
        return enum_type(value)
    except ValueError:
        allowed = ", ".join(repr(e.value) for e in enum_type)
        raise ValueError(f"{owner}.{name} must be one of {allowed}; got {value!r}") from None


def _check_optional_int(owner: str, name: str, value: Any, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
        raise ValueError(f"{owner}.{name} must be {bound} or None; got {value!r}")


def _check_int(owner: str, name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}; got {value!r}")


def _check_optional_float(owner: str, name: str, value: Any, low: float, high: float, *, open_low: bool) -> None:
    if value is None:
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    # Check the type before comparing (a string would raise TypeError); NaN fails every comparison, so test
    # that the value is inside the range rather than outside it.
    inside = is_number and (low < value if open_low else low <= value) and value <= high
    if not inside:
        bracket = "(" if open_low else "["
        raise ValueError(f"{owner}.{name} must be a float in {bracket}{low}, {high}] or None; got {value!r}")


def _check_modes(owner: str, name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    modes = tuple(value) if isinstance(value, (list, tuple)) else None
    if not modes or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in modes):
        raise ValueError(f"{owner}.{name} must be a non-empty sequence of ints >= 1 or None; got {value!r}")
    return modes


@dataclass(frozen=True)
class LayerSettings:
    """The settings that decide one layer's TT form; ``TensorizeConfig.settings_for(fqn)`` resolves them."""

    max_rank: int | None = 32
    rank_ratio: float | None = None
    rel_tol: float | None = None
    init: Init = Init.SVD
    num_modes: int | None = None
    row_modes: tuple[int, ...] | None = None
    col_modes: tuple[int, ...] | None = None
    linear_format: TTFormat = TTFormat.TT
    embedding_format: TTFormat = TTFormat.TTM
    max_pad_fraction: float = 0.25

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_optional_int(owner, "max_rank", self.max_rank, 1)
        _check_optional_float(owner, "rank_ratio", self.rank_ratio, 0.0, 1.0, open_low=True)
        _check_optional_float(owner, "rel_tol", self.rel_tol, 0.0, 1.0, open_low=False)
        _check_optional_int(owner, "num_modes", self.num_modes, 1, 12)
        if self.max_pad_fraction is None:
            raise ValueError(f"{owner}.max_pad_fraction must be a float in [0.0, 1.0]; got None")
        _check_optional_float(owner, "max_pad_fraction", self.max_pad_fraction, 0.0, 1.0, open_low=False)
        object.__setattr__(self, "init", _coerce_enum(owner, "init", self.init, Init))
        object.__setattr__(self, "linear_format", _coerce_enum(owner, "linear_format", self.linear_format, TTFormat))
        object.__setattr__(
            self, "embedding_format", _coerce_enum(owner, "embedding_format", self.embedding_format, TTFormat)
        )
        object.__setattr__(self, "row_modes", _check_modes(owner, "row_modes", self.row_modes))
        object.__setattr__(self, "col_modes", _check_modes(owner, "col_modes", self.col_modes))

    def format_for(self, kind: str) -> TTFormat:
        return self.embedding_format if kind == "embedding" else self.linear_format

    def tt_options(self, kind: str) -> dict[str, Any]:
        """Keyword arguments for ``comera_fx.tt.make_tt_matrix``."""
        return dict(
            format=self.format_for(kind),
            init=self.init.value,
            max_rank=self.max_rank,
            rank_ratio=self.rank_ratio,
            rel_tol=self.rel_tol,
            num_modes=self.num_modes,
            row_modes=self.row_modes,
            col_modes=self.col_modes,
            max_pad_fraction=self.max_pad_fraction,
        )


_LAYER_FIELDS = {f.name for f in dataclasses.fields(LayerSettings)}
_OVERRIDE_FIELDS = _LAYER_FIELDS | {"skip"}
_TENSORIZE_RENAMED = {"param_budget": "size_target"}  # renamed in 0.2: "budget" alone is time elsewhere
#: ``TensorizeConfig.expert_form`` values.
EXPERT_FORMS = ("per_expert", "shared")


@accepts_renamed(_TENSORIZE_RENAMED)
@dataclass(frozen=True)
class TensorizeConfig(LayerSettings):
    """What ``tensorize_`` converts and how.

    Args:
        max_rank: cap on every TT bond; a value above what a layer can use is clamped to its full rank, so a huge
            value means "exact" (with ``init="svd"``).
        rank_ratio: each bond's rank as a fraction of its full rank (then capped by ``max_rank``).
        rel_tol: relative Frobenius error allowed by TT-SVD; ranks are cut further where that suffices.
        init: ``"svd"`` (TT-SVD of the current weights) or ``"random"`` (the dense default init's variance).
        num_modes: modes per side (TT) or per core chain (TTM); ``None`` picks about one mode per factor of 10.
        row_modes / col_modes: explicit modes (usually given per layer through ``overrides``).
        linear_format / embedding_format: ``"tt"`` or ``"ttm"`` for linear-like ops and embedding lookups.
        max_pad_fraction: how far a badly factoring size may be padded up to find balanced modes.
        min_numel: only weights with at least this many elements are "large" (default 2^16)...
        min_dim: ...and both of whose dimensions are at least this (default 64).
        overrides: ``{regex: {field: value}}``; for a layer whose FQN matches (``re.search``), those fields
            replace the defaults, later entries winning. E.g. ``{r"lm_head": {"max_rank": 64}}``;
            ``{"skip": True}`` excludes the matching layers.
        skip: regexes of FQNs never to convert (``re.search``).
        seed: seed of the generator for ``init="random"`` (``None``: the global RNG).
        size_target: total parameters (TT cores + gates) of the layers this call converts, as an int, or as a
            float in (0, 1] the fraction of those layers' dense size. The ranks then come from ``allocation``
            (``max_rank`` / ``rank_ratio``, also in overrides, are not used); ``rel_tol`` must be None.
            (Was ``param_budget``, which still works with a ``DeprecationWarning``.)
        allocation: ``"uniform"`` (one max_rank, the largest whose total fits the size target) or ``"energy"``
            (ranks per layer and per bond, see ``comera_fx.tt.allocate``; needs ``init="svd"``).
        expert_form: how a transformers experts module's 3D weights become TT (docs/moe.md): ``"per_expert"``
            (default: each expert its own TT matrix) or ``"shared"`` (one TT chain over the experts side by side,
            one small core per expert; TT-SVD only; under a size target each shared chain is one layer of the
            allocation).
        weight_space: also convert a large weight that some op reads in a way with no TT rule (``P * x``,
            ``P @ x``, ``weight.norm()``): it is held in TT form and rebuilt from the cores for those reads (exact
            at full rank, a dense rebuild per read). Off by default: such a layer stays dense, with the op named.
            Expert weights get this form whenever their module's forward is not re-implemented (docs/moe.md).
    """

    min_numel: int = 2**16
    min_dim: int = 64
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    seed: int | None = None
    size_target: int | float | None = None
    allocation: Allocation = Allocation.UNIFORM
    expert_form: str = "per_expert"
    weight_space: bool = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        super().__post_init__()
        if not isinstance(self.weight_space, bool):
            raise ValueError(f"{owner}.weight_space must be True or False; got {self.weight_space!r}")
        if self.expert_form not in EXPERT_FORMS:
            raise ValueError(f"{owner}.expert_form must be one of {EXPERT_FORMS}; got {self.expert_form!r}")
        if self.expert_form == "shared" and self.init is not Init.SVD:
            raise ValueError(
                f"{owner}.expert_form='shared' is built by TT-SVD of the experts side by side: it needs "
                f"init='svd' (got init={self.init.value!r}); use expert_form='per_expert' for random init"
            )
        _check_size_target(owner, self.size_target)
        object.__setattr__(self, "allocation", _coerce_enum(owner, "allocation", self.allocation, Allocation))
        if self.size_target is not None and self.rel_tol is not None:
            raise ValueError(
                f"{owner}.rel_tol must be None when size_target is set (the size target decides the "
                f"ranks); got rel_tol={self.rel_tol!r}"
            )
        if self.allocation is Allocation.ENERGY and self.init is not Init.SVD:
            raise ValueError(
                f"{owner}.allocation='energy' needs init='svd' (it reads the weights' spectra); "
                f"got init={self.init.value!r}"
            )
        if isinstance(self.skip, str) or not isinstance(self.skip, (list, tuple)):
            raise ValueError(f"{owner}.skip must be a list or tuple of regex strings; got {self.skip!r}")
        for pattern in self.skip:
            _compile(owner, "skip", pattern)
        object.__setattr__(self, "skip", tuple(self.skip))
        _check_int(owner, "min_numel", self.min_numel, 0)
        _check_int(owner, "min_dim", self.min_dim, 1)
        _check_optional_int(owner, "seed", self.seed, 0)
        if not isinstance(self.overrides, Mapping):
            raise ValueError(f"{owner}.overrides must be a dict {{regex: {{field: value}}}}; got {self.overrides!r}")
        checked = {}
        for pattern, values in self.overrides.items():
            _compile(owner, "overrides", pattern)
            if not isinstance(values, Mapping):
                raise ValueError(f"{owner}.overrides[{pattern!r}] must be a dict of LayerSettings fields")
            unknown = set(values) - _OVERRIDE_FIELDS
            if unknown:
                raise ValueError(
                    f"{owner}.overrides[{pattern!r}] has unknown fields {sorted(unknown)}; "
                    f"allowed: {sorted(_OVERRIDE_FIELDS)}"
                )
            if not isinstance(values.get("skip", False), bool):
                raise ValueError(f"{owner}.overrides[{pattern!r}]['skip'] must be a bool")
            try:
                LayerSettings(**{k: v for k, v in values.items() if k != "skip"})
            except ValueError as exc:
                raise ValueError(f"{owner}.overrides[{pattern!r}]: {exc}") from None
            checked[pattern] = dict(values)
        object.__setattr__(self, "overrides", checked)

    def settings_for(self, fqn: str) -> LayerSettings:
        """The layer settings for one parameter FQN: defaults, then matching overrides in order."""
        values = {name: getattr(self, name) for name in _LAYER_FIELDS}
        for pattern, override in self.overrides.items():
            if re.search(pattern, fqn):
                values.update({k: v for k, v in override.items() if k != "skip"})
        return LayerSettings(**values)

    def is_skipped(self, fqn: str) -> bool:
        """True if ``skip`` or an override with ``skip=True`` matches the FQN."""
        skipped = any(re.search(p, fqn) for p in self.skip)
        for pattern, override in self.overrides.items():
            if "skip" in override and re.search(pattern, fqn):
                skipped = override["skip"]
        return skipped

    def is_large(self, shape: tuple[int, ...]) -> bool:
        """The size threshold: at least ``min_numel`` elements and every dimension at least ``min_dim``."""
        numel = 1
        for s in shape:
            numel *= s
        return len(shape) == 2 and numel >= self.min_numel and min(shape) >= self.min_dim

    @property
    def param_budget(self) -> int | float | None:
        """Deprecated spelling of ``size_target``."""
        warn_renamed("TensorizeConfig.param_budget", "TensorizeConfig.size_target", stacklevel=3)
        return self.size_target

    def replace(self, **changes: Any) -> "TensorizeConfig":
        changes = renamed_keywords(changes, _TENSORIZE_RENAMED, "TensorizeConfig", stacklevel=4)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (enums as strings), for logs and checkpoints; ``from_dict`` inverts it."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
        out["skip"] = list(self.skip)
        out["overrides"] = {k: dict(v) for k, v in self.overrides.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TensorizeConfig":
        data = renamed_keywords(data, _TENSORIZE_RENAMED, "TensorizeConfig", stacklevel=4)  # logs written before
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown TensorizeConfig fields {sorted(unknown)}")
        values = dict(data)
        if "skip" in values:
            values["skip"] = tuple(values["skip"])
        for name in ("row_modes", "col_modes"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)


def _check_size_target(owner: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return
    raise ValueError(
        f"{owner}.size_target must be an int >= 1 (parameters) or a float in (0, 1] (fraction of "
        f"the converted layers' dense size) or None; got {value!r}"
    )


def _compile(owner: str, name: str, pattern: Any) -> re.Pattern:
    if not isinstance(pattern, str):
        raise ValueError(f"{owner}.{name} entries must be regex strings; got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{owner}.{name} has an invalid regex {pattern!r}: {exc}") from None
