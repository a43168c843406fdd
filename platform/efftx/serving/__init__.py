"""Ray Serve deployments and their request/response schemas."""
