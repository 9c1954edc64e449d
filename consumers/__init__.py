"""The GPU consumer-group worker: intake, batching, engines, validation, routing, the commit line."""
