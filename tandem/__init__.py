"""Tandem: a Kubernetes-operated LLM inference microservice."""

__version__ = "0.1.0"
