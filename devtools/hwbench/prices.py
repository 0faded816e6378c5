"""The $/GPU-hour file of ``bench --prices``: a TOML table of GPU kind = price."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable
from pathlib import Path

EXAMPLE_PRICES = Path(__file__).with_name("prices.example.toml")


class PriceError(ValueError):
    """A prices file the study cannot use."""


def load_prices(path: str | Path, kinds: Iterable[str]) -> dict[str, float]:
    """The price of every kind in ``kinds``; PriceError for a missing kind, a price that is not
    a non-negative number, or a file that is not TOML."""
    try:
        with Path(path).open("rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise PriceError(f"{path}: prices file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise PriceError(f"{path}: invalid TOML: {e}") from None
    prices = {}
    for kind in kinds:
        if kind not in table:
            raise PriceError(
                f"{path}: no price for GPU kind {kind!r} (has: {', '.join(table) or 'none'})"
            )
        price = table[kind]
        if (
            isinstance(price, bool)
            or not isinstance(price, (int, float))
            or not math.isfinite(price)
            or price < 0
        ):
            raise PriceError(
                f"{path}: {kind} = {price!r}: a price must "
                f"be a non-negative number of $ per GPU-hour"
            )
        prices[kind] = float(price)
    return prices
