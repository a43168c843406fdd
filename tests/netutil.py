"""Small helpers shared by the tests that start servers."""

from __future__ import annotations

from efftx.cluster import free_port  # noqa: F401  (a TCP port nothing listens on right now)
