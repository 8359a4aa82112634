"""Azure Blob Storage: ``az://`` and portal URLs on the shared object-store client."""
