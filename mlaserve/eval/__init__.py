"""Accuracy checks: that swapping the attention backend changes nothing but speed."""
