"""Google Cloud Storage: ``gs://`` sources on the shared object-store client."""
