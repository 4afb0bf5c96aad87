"""turbollm's logger: INFO lines to stderr ("turbollm: ..."), unless the application configured its own.

Level from $TURBOLLM_LOG_LEVEL (default INFO); nothing is printed twice when the root logger
has handlers too (the "turbollm" logger does not propagate once it has its own handler).
"""

from __future__ import annotations

import logging
import os


def init_logger() -> logging.Logger:
    logger = logging.getLogger("turbollm")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("turbollm: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("TURBOLLM_LOG_LEVEL", "INFO").upper())
        logger.propagate = False
    return logger
