"""Tiered KV block store."""
