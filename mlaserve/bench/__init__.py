"""Benchmark clients: the online serving benchmark and the MLA decode kernel sweep."""
