"""Fixtures the interop tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def round_trips(tmp_path_factory: pytest.TempPathFactory):
    """Every family's round trip, measured once per session (``round_trip.RoundTrips``): the
    every-family test and the catalog page's doc test check the same measurements."""
    from round_trip import RoundTrips

    return RoundTrips(tmp_path_factory.mktemp("round-trips"))
