"""`kvjax.policy`: the adaptive resident/ring policy's names under a short path (the module is
`kvjax.streaming.policy`; patch that one)."""

from kvjax.streaming.policy import *  # noqa: F401,F403  pylint: disable=wildcard-import,unused-wildcard-import
