"""The federated simulation engine and its message types."""
