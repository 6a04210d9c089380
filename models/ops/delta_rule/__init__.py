"""Shared machinery of the delta-rule cores (KDA, GDN): chunk partition, chunkwise reference, boundary-state rounds."""
