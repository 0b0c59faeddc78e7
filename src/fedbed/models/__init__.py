"""Model architectures with separate featurizer and classifier."""

from fedbed.models.networks import MODELS, DomainClassifier, ModelError, build_model

__all__ = ["MODELS", "DomainClassifier", "ModelError", "build_model"]
