"""The typed records a unit measures (schema 3), their JSON round trip, and the older schemas read
back."""
