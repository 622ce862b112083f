"""Fixtures of the launcher tests (defined in ``launch_util``)."""

from launch_util import launchers, linux_only, port

__all__ = ["launchers", "linux_only", "port"]
