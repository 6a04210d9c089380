"""Shared machinery of the delta-rule cores (KDA, GDN): chunk partition, argument checks, chunkwise reference."""
