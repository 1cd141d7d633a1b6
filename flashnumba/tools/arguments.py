"""Argument types the commands share: a bad number is argparse's one-line error, before anything runs."""

from __future__ import annotations

import argparse


def at_least(low):
    """An argparse type: a number of at least ``low`` (an int where ``low`` is one, else a float)."""

    def parse(text):
        try:
            x = type(low)(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a{'n int' if isinstance(low, int) else ' number'}, got {text!r}") \
                from None
        if not low <= x < float("inf"):  # (NaN compares false: refused too)
            raise argparse.ArgumentTypeError(f"a finite number of at least {low}, got {text}")
        return x

    return parse
