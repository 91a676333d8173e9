"""The Kubernetes operator (import name tandem.operator): runs ModelServer resources; not built yet."""
