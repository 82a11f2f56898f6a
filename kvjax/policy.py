"""`kvjax.policy` is `kvjax.streaming.policy` (the adaptive resident/ring policy) under its short
name: importing it yields that very module."""

import sys

from kvjax.streaming import policy as _policy

sys.modules[__name__] = _policy
