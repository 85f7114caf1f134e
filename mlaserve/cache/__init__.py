"""The KV block pool (used by the engine's scheduler)."""
