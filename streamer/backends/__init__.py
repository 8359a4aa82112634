"""Storage backends other than the native engine's local reads (S3)."""
