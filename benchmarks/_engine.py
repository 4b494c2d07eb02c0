"""What a fitted regression distiller's engine is: the benchmarks' one reading of it."""

from __future__ import annotations


def engine_of(model):
    """The engine of ``model``'s current fit (fitted first where needed)."""
    return model._current_fit().engine


def engine_name(model) -> str:
    """The engine's backend: what ``backend="auto"`` ended on."""
    return engine_of(model).name


def krylov_rank(model) -> int:
    """Ritz pairs the fit computed (0 for the dense and Cholesky engines)."""
    ritz = getattr(engine_of(model), "ritz_values", None)
    return 0 if ritz is None else int(ritz.shape[-1])


def series_order(model) -> str:
    """The order of the truncated spectrum's complement series, ``—`` where there is none."""
    engine = engine_of(model)
    return str(engine.series_order) if getattr(engine, "is_truncated", False) else "—"
