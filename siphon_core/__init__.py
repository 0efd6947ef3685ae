"""Parts shared by the producer and the Dagster code location: configuration, names, wire format."""
