"""The set of ranks that serve together: who they are and how they talk."""

from mlxserve.cluster.composition import Cluster, Composition

__all__ = ["Cluster", "Composition"]
